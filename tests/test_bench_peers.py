"""benchmarks.peers and the bandwidth yardstick, the parts that need no build: reading
llama-bench's and llama-batched-bench's outputs (samples captured from the llama.cpp the
benchmark builds: llama-cpp-python 0.3.36's vendor/llama.cpp, 0c1e570, on the 0.5b
model's q8_0 GGUF), the bytes a llama.cpp step reads, each row's share of the memory's
read bandwidth and its ratio to llama.cpp, and the daemon rows' share in benchmarks.serve.

Why: the share is the figure issue 60's lines are drawn in (batch 1 >= 85% of the
memory's bandwidth); an arithmetic slip there, or a parser that reads llama.cpp's
prompt speed as its decode speed, would move every ratio the docs quote.

Nothing here downloads, builds or times anything (the build is ``--build``, by hand).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks import harness, peers, serve

# `llama-bench -m deepseek-v3-0.5b-mtp-q8_0.gguf -t 2 -p 0 -n 16 -r 2 -o json` (stdout; some
# fields left out)
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "AMD EPYC",
    "backends": "CPU",
    "model_filename": ".cache/peers/gguf/deepseek-v3-0.5b-mtp-q8_0.gguf",
    "model_type": "deepseek2 ?B Q8_0",
    "model_size": 580329024,
    "model_n_params": 545459088,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "type_k": "f16",
    "type_v": "f16",
    "n_prompt": 0,
    "n_gen": 16,
    "n_depth": 0,
    "test_time": "2026-12-06T04:23:08Z",
    "avg_ns": 17757838648,
    "stddev_ns": 1288903244,
    "avg_ts": 5.050600,
    "stddev_ts": 6.474243,
    "samples_ns": [ 33853957833, 1661719464 ],
    "samples_ts": [ 0.472618, 9.62858 ]
  }
]
"""

# `llama-bench -m ...-q8_0.gguf -t 2 -p 16 -n 4 -r 1` (the default markdown; stdout)
LLAMA_BENCH_MD = """\
| model                          |       size |     params | backend    | threads |            test |                  t/s |
| ------------------------------ | ---------: | ---------: | ---------- | ------: | --------------: | -------------------: |
| deepseek2 ?B Q8_0              | 553.44 MiB |   545.46 M | CPU        |       2 |            pp16 |          7.21 ± 0.00 |
| deepseek2 ?B Q8_0              | 553.44 MiB |   545.46 M | CPU        |       2 |             tg4 |          2.24 ± 0.00 |

build: 0c1e570 (1)
"""

# `llama-batched-bench -m ...-q8_0.gguf -t 2 -npp 8 -ntg 4 -npl 1,2` (stdout)
BATCHED_BENCH_MD = """
llama_batched_bench: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|     8 |      4 |    1 |     12 |    0.532 |    15.05 |    3.115 |     1.28 |    3.647 |     3.29 |
|     8 |      4 |    2 |     24 |    1.063 |    15.06 |    0.593 |    13.48 |    1.656 |    14.49 |

"""

# its --output-format jsonl line (the format string of tools/batched-bench/batched-bench.cpp)
BATCHED_BENCH_JSONL = (
    '{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
    '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 32, "tg": 64, "pl": 8, "n_kv": 768, '
    '"t_pp": 1.000000, "speed_pp": 256.000000, "t_tg": 4.000000, "speed_tg": 128.000000, "t": 5.000000, '
    '"speed": 153.600000}\n')

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 avx fma f16c avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_vnni
processor\t: 1
flags\t\t: fpu
"""


def test_llama_bench_json():
    [row] = peers.parse_llama_bench(LLAMA_BENCH_JSON)
    assert row["test"] == "tg16" and row["n_gen"] == 16 and row["n_prompt"] == 0
    assert row["tok_s"] == pytest.approx(5.0506)
    assert row["samples"] == pytest.approx([0.472618, 9.62858])
    assert row["build"] == "0c1e570"


def test_llama_bench_json_after_log_lines():
    """llama-bench's stdout can carry lines before the array; the array is read."""
    [row] = peers.parse_llama_bench("some log line\n" + LLAMA_BENCH_JSON)
    assert row["tok_s"] == pytest.approx(5.0506)


def test_llama_bench_markdown():
    pp, tg = peers.parse_llama_bench(LLAMA_BENCH_MD)
    assert (pp["test"], pp["n_prompt"], pp["n_gen"], pp["tok_s"]) == ("pp16", 16, 0, 7.21)
    assert (tg["test"], tg["n_prompt"], tg["n_gen"], tg["tok_s"]) == ("tg4", 0, 4, 2.24)
    assert pp["build"] == tg["build"] == "0c1e570"
    assert pp["model_type"] == "deepseek2 ?B Q8_0"


def test_batched_bench_markdown():
    rows = peers.parse_batched_bench(BATCHED_BENCH_MD)
    assert [(r["pp"], r["tg"], r["pl"]) for r in rows] == [(8, 4, 1), (8, 4, 2)]
    # the decode speed of all sequences is S_TG, not S_PP or S
    assert [r["s_tg"] for r in rows] == [1.28, 13.48]
    assert rows[1]["s_pp"] == 15.06 and rows[1]["t_tg"] == 0.593


def test_batched_bench_jsonl():
    [row] = peers.parse_batched_bench(BATCHED_BENCH_JSONL)
    assert (row["pp"], row["tg"], row["pl"], row["s_tg"], row["s_pp"]) == (32, 64, 8, 128.0, 256.0)


class _Done:
    def __init__(self, out: str) -> None:
        self.returncode, self.stdout, self.stderr = 0, out, ""


def test_run_peer_reads_the_right_workload(monkeypatch):
    """llama-bench -n 0 is the prompt row, -p 0 the batch-1 decode row; llama-batched-bench
    gives decode b8 (S_TG at 8 sequences) and its b1 row apart."""
    header = "\n".join(LLAMA_BENCH_MD.splitlines()[:2])
    prompt = header + "\n| deepseek2 ?B Q8_0 | 553.44 MiB | 545.46 M | CPU | 2 | pp256 | 253.10 ± 2.00 |\n"
    eight = BATCHED_BENCH_MD.replace("|    2 |", "|    8 |")
    out = {"llama-bench": prompt, "llama-batched-bench": eight}
    monkeypatch.setattr(peers.subprocess, "run", lambda cmd, **kw: _Done(out[Path(cmd[0]).name]))
    assert peers.run_peer(["/x/llama-bench", "-p", "256", "-n", "0"]) == ({"prompt": 253.1}, None)
    assert peers.run_peer(["/x/llama-batched-bench"]) == (
        {"decode b8": 13.48, "decode b1 (batched-bench)": 1.28}, None)
    out["llama-bench"] = LLAMA_BENCH_JSON
    assert peers.run_peer(["/x/llama-bench", "-p", "0", "-n", "16"]) == ({"decode b1": 5.0506}, "0c1e570")


def test_run_peer_without_a_row_for_8_fails(monkeypatch):
    monkeypatch.setattr(peers.subprocess, "run", lambda cmd, **kw: _Done(BATCHED_BENCH_MD))
    with pytest.raises(RuntimeError, match="no row for 8"):
        peers.run_peer(["/x/llama-batched-bench"])


def test_bandwidth_share_arithmetic():
    # 483 MB a step at 60 steps/s is 28.98 GB/s: all of a 28.98 GB/s memory
    assert harness.bandwidth_share(483e6, 60, 28.98) == pytest.approx(1.0)
    assert harness.bandwidth_share(442e6, 57.5, 28.9) == pytest.approx(442e6 * 57.5 / 28.9e9)
    assert harness.bandwidth_share(0, 60, 28.9) == 0


def test_memory_yardstick_is_the_median_reading():
    """One reading strays both ways on a shared machine; the shares use the median."""
    readings = [{"gbps": g} for g in (16.8, 28.9, 27.5, 48.7, 29.3)]
    assert peers.memory_yardstick(readings) == 28.9


def test_expected_experts():
    assert harness.expected_experts(16, 4, 1) == pytest.approx(4)
    assert harness.expected_experts(16, 4, 2) == pytest.approx(16 * (1 - 0.75 ** 2))   # 7
    assert harness.expected_experts(16, 4, 256) == pytest.approx(16)
    assert harness.expected_experts(0, 0, 8) == 0


def test_gguf_step_bytes():
    """The embedding's rows looked up, the routed experts' expected share, the rest whole."""
    tensors = [("token_embd.weight", 1000 * 10), ("blk.1.ffn_up_exps.weight", 1600),
               ("blk.1.ffn_down_exps.weight", 1600), ("blk.1.attn_q_a.weight", 300),
               ("output.weight", 1000 * 10), ("output_norm.weight", 40)]
    info = {"experts": 16, "experts_used": 4, "vocab": 1000}
    one = peers.gguf_step_bytes(tensors, info, 1)
    assert one == 10 + 3200 // 4 + 300 + 10000 + 40
    two = peers.gguf_step_bytes(tensors, info, 2)
    assert two == int(20 + 3200 * 7 / 16 + 300 + 10000 + 40)
    # a prompt of many tokens reads every expert (and no more of the table than it has)
    assert peers.gguf_step_bytes(tensors, info, 5000) == 10000 + 3200 + 300 + 10000 + 40


def test_summarize_shares_and_ratios():
    raw = {("llama.cpp", "bf16", "-", "decode b1"): [{"tok_s": 50.0}, {"tok_s": 60.0}, {"tok_s": 55.0}],
           ("ours", "bf16", "off", "decode b1"): [{"tok_s": 30.0, "tok_per_step": 1.0}],
           ("ours", "bf16", "k1", "decode b1"): [{"tok_s": 45.0, "tok_per_step": 1.8}],
           ("ours", "bf16", "k2", peers.TEXT_B1): [{"tok_s": 66.0, "tok_per_step": 2.4}],
           ("ours", "int8", "off", "decode b8"): [{"tok_s": 80.0, "tok_per_step": 1.0}],
           ("llama.cpp", "int8", "-", "decode b8"): [{"tok_s": 100.0}],
           ("ours", "bf16", "off", "prompt"): [{"tok_s": 512.0}],
           ("llama.cpp", "bf16", "-", "prompt"): [{"tok_s": 256.0}]}
    seen = []

    def bytes_of(side, weights, mode, tokens):
        seen.append((side, weights, mode, tokens))
        return {"off": 400e6, "k1": 600e6, "k2": 440e6, "-": 400e6}[mode] * (2 if tokens == 8 else 1)

    gbps = 20.0
    rows = {(r["side"], r["weights"], r["mode"], r["workload"]): r for r in peers.summarize(raw, gbps, bytes_of)}
    peer = rows[("llama.cpp", "bf16", "-", "decode b1")]
    assert peer["tok_s"] == 55.0 and peer["runs"] == [50.0, 60.0, 55.0]
    assert peer["share"] == pytest.approx(400e6 * 55 / 20e9)        # one token a step
    off = rows[("ours", "bf16", "off", "decode b1")]
    assert off["share"] == pytest.approx(400e6 * 30 / 20e9) and off["vs_llama_cpp"] == pytest.approx(30 / 55)
    k1 = rows[("ours", "bf16", "k1", "decode b1")]
    assert k1["steps_s"] == pytest.approx(45 / 1.8)                 # 1.8 tokens a step
    assert k1["share"] == pytest.approx(600e6 * 25 / 20e9)
    b8 = rows[("ours", "int8", "off", "decode b8")]
    assert b8["steps_s"] == pytest.approx(10.0)                     # 8 sequences a step
    assert b8["share"] == pytest.approx(800e6 * 10 / 20e9) and b8["vs_llama_cpp"] == pytest.approx(0.8)
    text = rows[("ours", "bf16", "k2", peers.TEXT_B1)]             # set against llama.cpp's batch 1
    assert text["vs_llama_cpp"] == pytest.approx(66 / 55) and text["steps_s"] == pytest.approx(66 / 2.4)
    prompt = rows[("ours", "bf16", "off", "prompt")]
    assert prompt["steps_s"] == pytest.approx(2.0) and prompt["vs_llama_cpp"] == pytest.approx(2.0)
    assert ("ours", "bf16", "off", peers.PROMPT_TOKENS) in seen and ("ours", "int8", "off", 8) in seen
    table = peers.format_table(list(rows.values()))
    assert "| llama.cpp bf16 | 55.0 (110%) |" in table
    assert "| ours bf16, MTP k=1 | 45.0 (75%; 0.82x) |  |" in table
    assert "| ours bf16, MTP k=2 |  | 66.0 (60%; 1.20x; 2.40) |  |  |" in table     # tokens a window
    assert "ours W8A8_DYNAMIC, MTP off |  |  | 80.0 (40%; 0.80x) |" in table
    assert "| ours bf16, MTP off | decode b1 | 30.0 |" in peers.format_details(list(rows.values()))


def test_rounds_pair_with_the_reading_before_them_and_with_the_peer_of_their_round():
    """A host whose bandwidth flips between two levels: each round's share is taken against
    the reading just before its job, and ours over llama.cpp round by round, so a run whose
    rounds fell on both levels still reads what each job met."""
    raw = {("llama.cpp", "bf16", "-", "decode b1"): [{"tok_s": 50.0, "gbps_before": 25.0},
                                                     {"tok_s": 100.0, "gbps_before": 50.0},
                                                     {"tok_s": 52.0, "gbps_before": 26.0}],
           ("ours", "bf16", "off", "decode b1"): [{"tok_s": 55.0, "tok_per_step": 1.0, "gbps_before": 25.0},
                                                  {"tok_s": 110.0, "tok_per_step": 1.0, "gbps_before": 50.0},
                                                  {"tok_s": 57.2, "tok_per_step": 1.0, "gbps_before": 26.0}],
           ("ours", "bf16", "k1", "decode b1"): [{"tok_s": 60.0, "tok_per_step": 1.5, "gbps_before": 25.0}]}
    rows = {(r["side"], r["mode"]): r for r in peers.summarize(raw, 40.0, lambda *a: 400e6)}
    off, peer = rows[("ours", "off")], rows[("llama.cpp", "-")]
    # every round streams 88% of the reading before it; against the run's median reading, 57%
    assert off["share_paired"] == pytest.approx(400e6 * 55 / 25e9)
    assert off["share"] == pytest.approx(400e6 * 57.2 / 40e9)
    assert peer["share_paired"] == pytest.approx(0.8)
    assert off["vs_llama_cpp_rounds"] == pytest.approx({"median": 1.1, "min": 1.1, "max": 1.1})
    assert rows[("ours", "k1")]["share_paired"] == pytest.approx(400e6 * 40 / 25e9)   # 1.5 tokens a step
    assert rows[("ours", "k1")]["vs_llama_cpp_rounds"]["median"] == pytest.approx(60 / 50)
    table = peers.format_paired(list(rows.values()))
    assert "| ours bf16, MTP off | decode b1 | 88% | 1.10x (1.10-1.10) |" in table
    assert "| llama.cpp bf16 | decode b1 | 80% | - |" in table


def test_cpu_flags():
    flags = peers.cpu_flags(CPUINFO)
    assert "avx512_bf16" in flags and flags[0] == "fpu"
    assert peers.vector_flags(flags) == ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                                         "avx512_vnni", "avx512_bf16"]


def test_peer_commands(tmp_path):
    """The commands of issue 60, on both GGUF files, with the threads asked for."""
    cmds = peers.peer_commands(tmp_path / "m-bf16.gguf", 2, tmp_path)
    assert Path(cmds["decode b1"][0]).name == "llama-bench"
    assert cmds["decode b1"][1:] == ["-m", str(tmp_path / "m-bf16.gguf"), "-t", "2", "-p", "0", "-n", "64",
                                     "-r", "3", "-o", "json"]
    assert cmds["prompt"][cmds["prompt"].index("-p") + 1] == "256"
    assert cmds["decode b8"][3:] == ["-t", "2", "-npp", "32", "-ntg", "64", "-npl", "1,8"]


def test_serve_row_share():
    """A daemon row: bytes a step weighted by the steps at each k; tokens a sequence a step
    1 where nothing was drafted, the mean accepted length where it was."""
    def step_bytes(weights, c, k):
        return {0: 400e6, 1: 600e6, 2: 800e6}[k]
    off = {"output_tok_s": 30.0, "tpot_median": 0.025, "steps_per_k": {}, "mean_accepted_len": None}
    sh = serve.row_share(off, 1, 0, Path("w"), 20.0, step_bytes)
    assert sh["step_bytes"] == 400e6 and sh["tokens_per_seq_step"] == 1.0
    assert sh["share"] == pytest.approx(400e6 * 30 / 20e9)
    assert sh["decode_share"] == pytest.approx(400e6 * 40 / 20e9)
    k1 = {"output_tok_s": 72.0, "tpot_median": None, "steps_per_k": {0: 25.0, 1: 75.0, 2: 0.0},
          "mean_accepted_len": 1.8}
    sh = serve.row_share(k1, 4, 1, Path("w"), 20.0, step_bytes)
    assert sh["step_bytes"] == pytest.approx(0.25 * 400e6 + 0.75 * 600e6)
    assert sh["tokens_per_seq_step"] == pytest.approx(0.25 + 0.75 * 1.8)
    assert sh["share"] == pytest.approx(sh["step_bytes"] * 72 / 4 / sh["tokens_per_seq_step"] / 20e9)
    assert "decode_share" not in sh


def test_serve_paired_ratios_pair_each_rep():
    """Rep by rep against the baseline's burst of the same rep and concurrency: a slow rep
    of one daemon is never set against a fast rep of the other, as the medians' ratio is."""
    raw = {"off": {8: [{"output_tok_s": 200.0}, {"output_tok_s": 300.0}, {"output_tok_s": 210.0}]},
           "k1": {8: [{"output_tok_s": 190.0}, {"output_tok_s": 330.0}, {"output_tok_s": 231.0}]}}
    table = {name: {8: harness.medians(runs)} for name, per in raw.items() for runs in per.values()}
    serve.paired_ratios(table, raw, "off")
    assert table["off"][8]["vs_baseline_rounds"] is None
    rounds = table["k1"][8]["vs_baseline_rounds"]
    assert rounds["median"] == pytest.approx(1.1) and rounds["min"] == pytest.approx(0.95)
    assert table["k1"][8]["output_tok_s"] / table["off"][8]["output_tok_s"] == pytest.approx(231 / 210)


def test_peers_json_is_plain(tmp_path):
    """What --json writes round-trips (a report saved outside docs/bench)."""
    rows = peers.summarize({("ours", "bf16", "off", "decode b1"): [{"tok_s": 30.0, "tok_per_step": 1.0}]},
                           20.0, lambda *a: 400e6)
    dest = harness.save_report({"rows": rows}, tmp_path / "p.json")
    assert json.loads(dest.read_text())["rows"][0]["share"] == pytest.approx(0.6)


def test_int8_heads_are_read_from_the_checkpoint_and_named_in_the_rows(tmp_path):
    """A W8A8 copy whose vocabulary heads are int8 (training.quantize --quant-heads) is named
    so in the table: against q8_0 it reads its head a byte a weight, as llama.cpp does."""
    def folder(name: str, config: dict, desc: dict | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        if desc is not None:
            (d / "quant_model_description.json").write_text(json.dumps(desc))
        return d

    ct = {"quantization_config": {"quant_method": "compressed-tensors"}}
    assert peers.heads_int8(folder("ct_heads", {"quantization_config": {**ct["quantization_config"],
                                                                        "ignore": ["re:.*kv_b_proj$"]}}))
    assert not peers.heads_int8(folder("ct", {"quantization_config": {**ct["quantization_config"],
                                                                      "ignore": ["lm_head"]}}))
    assert peers.heads_int8(folder("ms_heads", {}, {"lm_head.weight": "W8A8_DYNAMIC"}))
    assert not peers.heads_int8(folder("ms", {}, {"lm_head.weight": "FLOAT"}))
    row = {"side": "ours", "weights": "int8", "mode": "off"}
    assert peers.row_label(row) == "ours W8A8_DYNAMIC, MTP off"
    assert peers.row_label({**row, "int8_head": True}) == "ours W8A8_DYNAMIC, int8 head, MTP off"


def test_spread_max_tokens_average_the_fixed_length_and_drift_apart():
    """Spread lengths keep a burst's work (their mean is max_tokens over a cycle) while no
    eight neighbours end together."""
    lens = [harness.spread_max_tokens(64, i) for i in range(65)]
    assert min(lens) == 32 and max(lens) == 96 and statistics.fmean(lens) == 64
    assert len(set(lens[:8])) == 8
    assert harness.spread_max_tokens(1, 5) >= 1


def test_serve_async_plan_turns_every_daemon_async_or_adds_an_async_twin():
    from benchmarks import serve
    plan = (("off", 0, False, None, False), ("k2", 2, False, None, False))
    assert serve.async_plan(plan, "off") == plan
    assert serve.async_plan(plan, "on") == (("off", 0, True, None, False), ("k2", 2, True, None, False))
    assert [p[:3] for p in serve.async_plan(plan, "both")] == [
        ("off", 0, False), ("off-async", 0, True), ("k2", 2, False), ("k2-async", 2, True)]

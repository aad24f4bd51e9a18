"""``python -m server [--config-file PATH] [--check] [--log-level LEVEL]``

The only place that reads the process environment: it is handed to load_config.
Exit codes: 0 ok, 1 could not serve, 2 bad arguments or bad config.

A config whose parallel layout follows MindIE's rules but needs a kind of parallelism this
build does not serve (dp and sp both above 1, or sp or dp above 1 with the KV tiers
or swap preemption: config/parallel.py ``unserved_parallel``,
``unserved_with_striped_kv``) is valid, and still not served: the daemon refuses it
before anything is loaded, exit 1, and ``--check`` says so and exits 1 too, so that
``--check`` passing means the daemon starts.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Mapping, Sequence

from server.config import AppConfig, ConfigError, default_config_path, load_config
from server.config.parallel import describe_layout
from server.config.parallel_layout import CONTIGUOUS_GROUPS, STRIDED_GROUPS, ParallelLayout

EXIT_OK, EXIT_NOT_SERVED, EXIT_BAD_CONFIG = 0, 1, 2   # 1 (could not serve) also from server.daemon


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="OpenAI-compatible DeepSeek serving daemon with MTP, configured like MindIE.")
    parser.add_argument("--config-file", default=str(default_config_path(env)),
                        help="MindIE-style config.json (default: $MIES_CONFIG_JSON_PATH, "
                             "else conf/config.json)")
    parser.add_argument("--check", action="store_true",
                        help="validate, print the effective config as JSON and exit "
                             "(0 valid and served, 1 valid but not served by this build, "
                             "2 invalid)")
    parser.add_argument("--log-level", default="info", type=str.lower,
                        choices=["debug", "info", "warning", "error"], help="default: info")
    return parser


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    args = build_parser(env).parse_args(argv)      # unknown argument: usage + exit 2
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config_file, env)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.check:
        json.dump(cfg.to_dict(), sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"parallel layout follows MindIE's rules: {describe_layout(cfg.parallel)}",
              file=sys.stderr)
        for line in describe_groups(cfg.parallel):
            print(line, file=sys.stderr)
        if cfg.unserved:
            print(unserved_report(cfg), file=sys.stderr)
            return EXIT_NOT_SERVED
        return EXIT_OK
    return serve(cfg)


def describe_groups(layout: ParallelLayout) -> list[str]:
    """The process groups the daemon builds (each kind above one rank), as rank lists:
    what an operator checks against the devices' links before starting 16 processes."""
    return [f"  {kind} groups: " + " ".join("[" + ",".join(map(str, g)) + "]" for g in layout.groups(kind))
            for kind in CONTIGUOUS_GROUPS + STRIDED_GROUPS if getattr(layout, kind) > 1]


def unserved_report(cfg: AppConfig) -> str:
    """What --check and the refused start print for a layout this build does not serve."""
    lines = [f"error: not served by this build ({len(cfg.unserved)} key(s)); the layout "
             "follows MindIE's rules, but the daemon refuses to start on it:"]
    lines += [f"  - {issue.path}: {issue.message}" for issue in cfg.unserved]
    return "\n".join(lines)


def serve(cfg: AppConfig) -> int:
    """Run the daemon until it stops and return its exit code (0 after a clean drain, 1
    when it could not serve). Imported here, not at the top, so ``--check`` validates a
    config without loading torch and the model code.  A layout this build does not serve
    is refused here, before any of that is imported (node 0 and worker nodes alike)."""
    if cfg.unserved:
        print(unserved_report(cfg), file=sys.stderr)
        return EXIT_NOT_SERVED
    if cfg.parallel.node_rank > 0:          # a worker node of a multi-node group
        from server.node import run_node
        return run_node(cfg)
    from server.daemon import run_daemon
    return run_daemon(cfg)


if __name__ == "__main__":
    sys.exit(main())

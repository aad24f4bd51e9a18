"""``python -m server [--config-file PATH] [--check] [--log-level LEVEL]``

The only place that reads the process environment: it is handed to load_config.
Exit codes: 0 ok, 1 could not serve, 2 bad arguments or bad config.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Mapping, Sequence

from server.config import AppConfig, ConfigError, default_config_path, load_config

EXIT_OK, EXIT_BAD_CONFIG = 0, 2     # 1 (could not serve) comes from server.daemon


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="OpenAI-compatible DeepSeek serving daemon with MTP, configured like MindIE.")
    parser.add_argument("--config-file", default=str(default_config_path(env)),
                        help="MindIE-style config.json (default: $MIES_CONFIG_JSON_PATH, "
                             "else conf/config.json)")
    parser.add_argument("--check", action="store_true",
                        help="validate, print the effective config as JSON and exit "
                             "(0 valid, 2 invalid)")
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
        return EXIT_OK
    return serve(cfg)


def serve(cfg: AppConfig) -> int:
    """Run the daemon until it stops and return its exit code (0 after a clean drain, 1
    when it could not serve). Imported here, not at the top, so ``--check`` validates a
    config without loading torch and the model code."""
    if cfg.parallel.node_rank > 0:          # a worker node of a multi-node group
        from server.node import run_node
        return run_node(cfg)
    from server.daemon import run_daemon
    return run_daemon(cfg)


if __name__ == "__main__":
    sys.exit(main())

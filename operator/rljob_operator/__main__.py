"""python -m rljob_operator: run the operator (the same as `kopf run -m rljob_operator.handlers`).

    python -m rljob_operator --namespace team-a --namespace 'rl-*'   # namespaces (globs allowed)
    python -m rljob_operator --all-namespaces                          # cluster-wide
    python -m rljob_operator -A --peering rljob                        # HA pair with kopf peering

Configuration beyond these flags comes from RLJOB_* environment variables (rljob_operator.settings).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rljob_operator", description=__doc__.split("\n")[0])
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", dest="namespaces", metavar="NS",
                       help="serve this namespace (repeatable; globs like 'team-*' allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve all namespaces")
    parser.add_argument("--peering", metavar="NAME", default=None,
                        help="coordinate with other operator replicas through kopf peering NAME (default: standalone)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="port of the operator's /metrics (overrides RLJOB_OPERATOR_METRICS_PORT; 0 disables)")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.metrics_port is not None:
        os.environ["RLJOB_OPERATOR_METRICS_PORT"] = str(args.metrics_port)  # read by settings at import
    import kopf

    kopf.configure(verbose=args.verbose, quiet=args.quiet, log_prefix=True)  # [namespace/name] in each line
    for noisy in ("kubernetes", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    from rljob_operator import handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        clusterwide=bool(args.all_namespaces),
        namespaces=args.namespaces or (),
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

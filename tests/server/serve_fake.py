"""``python -m tests.server.serve_fake FOLDER [serve flags]``: run_server with the CLI's serve flags over a
FakeEngine (loaded after a short delay, so /health can be seen answering 503 first).  Used by test_run_server."""
import argparse
import sys
import time

import pegainfer  # noqa: F401  (device selection before anything else)
from pegainfer.server import add_serve_arguments, run_server
from tests.server.fake_engine import FakeEngine


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--load-seconds", type=float, default=1.0)
    p.add_argument("--model-path", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--log-level", default="info")   # (the CLI's flag, applied the way the CLI applies it)
    p.add_argument("--stats-interval", type=float, default=None)   # the stats lines' interval, shortened
    add_serve_arguments(p)
    args = p.parse_args()

    def factory():
        time.sleep(args.load_seconds)
        if args.folder == "broken":
            from pegainfer.errors import ModelFolderError
            raise ModelFolderError("/nowhere has no config.json: download the model into it")
        return FakeEngine(args.folder, step_delay=0.005, chat_template=args.chat_template)

    if args.stats_interval is not None:
        from pegainfer.engine import stats_log
        stats_log.INTERVAL_S = args.stats_interval
    import logging
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return run_server(args, engine_factory=factory)
    except pegainfer.errors.PegainferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``python -m engine --model M --address ipc://… | tcp://…``: load a model and serve it."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from engine.config import EngineConfig, ServiceConfig, add_arguments, from_arguments
from engine.curve_auth import SocketSecurityError, check_security


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    add_arguments(parser, EngineConfig)
    add_arguments(parser, ServiceConfig)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s engine %(name)s: %(message)s",
    )
    service_config = from_arguments(ServiceConfig, args)
    try:
        check_security(service_config)  # before minutes of loading weights
    except SocketSecurityError as exc:
        logging.getLogger("engine").error("cannot serve: %s", exc)
        sys.exit(2)
    from engine.llm_engine import LLMEngine
    from engine.roofline import save_steps
    from engine.service import EngineService

    engine = LLMEngine(from_arguments(EngineConfig, args))
    if args.step_record:
        engine.step_shapes = []
    service = EngineService(engine, service_config)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: service.request_stop())
    service.serve_forever()
    engine.close()
    if engine.step_shapes is not None:
        save_steps(args.step_record, engine.step_shapes)
    logging.getLogger("engine").info("engine stopped")
    sys.exit(0)


if __name__ == "__main__":
    main()

"""``python -m engine --model M --address ipc://… | tcp://…``: load a model and serve it.

``python -m engine generate --model M --prompt "…"``: load it, answer one prompt (through the
model's chat template, if it has one) and print the answer.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import NoReturn

from engine.config import EngineConfig, ServiceConfig, add_arguments, from_arguments
from engine.service.address import (
    AddressUnavailableError,
    check_address_free,
    remove_socket_file,
)
from engine.service.curve_auth import SocketSecurityError, check_security

logger = logging.getLogger("engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    add_arguments(parser, EngineConfig)
    add_arguments(parser, ServiceConfig)
    return parser.parse_args(argv)


def parse_generate_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m engine generate", description="Answer one prompt and print the answer."
    )
    parser.add_argument("--prompt", required=True, help="the prompt (a user message, in a chat)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    parser.add_argument(
        "--temperature", type=float, default=None, help="0: greedy (default: the model's)"
    )
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render the prompt as a user message through the chat template "
        "(default: when the model has one)",
    )
    parser.add_argument("--log-level", default="warning", help="logging level")
    add_arguments(parser, EngineConfig)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["generate"]:
        generate(parse_generate_args(argv[1:]))
        return
    args = parse_args(argv)
    _configure_logging(args.log_level)
    service_config = from_arguments(ServiceConfig, args)
    try:
        # Before minutes of loading weights.
        check_security(service_config)
        check_address_free(service_config.address)
    except (SocketSecurityError, AddressUnavailableError) as exc:
        _refuse(exc)
    from engine.llm_engine import LLMEngine
    from engine.roofline import save_steps
    from engine.service.engine_service import EngineService

    try:
        engine = LLMEngine(from_arguments(EngineConfig, args))
    except ValueError as exc:
        # The engine's word for options it cannot run with (a model path that is none, a
        # KV cache too small for one block, options that contradict each other): the
        # message names them, so a traceback says nothing more to the operator.
        logger.debug("refused at start-up", exc_info=True)
        _refuse(exc)
    if args.step_record:
        engine.step_shapes = []
    service = EngineService(engine, service_config)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: service.request_stop())
    try:
        service.serve_forever()
    finally:
        remove_socket_file(service_config.address)
    engine.close()
    if engine.step_shapes is not None:
        save_steps(args.step_record, engine.step_shapes)
    logger.info("engine stopped")
    sys.exit(0)


def _refuse(problem: Exception) -> NoReturn:
    logger.error("cannot serve: %s", problem)
    sys.exit(2)


def generate(args: argparse.Namespace) -> None:
    _configure_logging(args.log_level)
    from engine.llm import LLM

    config = from_arguments(EngineConfig, args)
    try:
        llm = LLM(**vars(config))
    except ValueError as exc:
        # As when serving: a model or options the engine cannot run with, named in one line.
        logger.debug("refused at start-up", exc_info=True)
        _refuse(exc)
    sampling = llm.default_sampling_params()
    sampling.max_tokens = args.max_tokens
    if args.temperature is not None:
        sampling.temperature = args.temperature
    chat = args.chat if args.chat is not None else llm.chat_template is not None
    if chat:
        messages = [{"role": "user", "content": args.prompt}]
        (output,) = llm.chat(messages, sampling, use_tqdm=False)
    else:
        (output,) = llm.generate(args.prompt, sampling, use_tqdm=False)
    llm.close()
    print(output.outputs[0].text)


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s engine %(name)s: %(message)s",
    )


if __name__ == "__main__":
    main()

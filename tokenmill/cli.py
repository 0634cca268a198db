"""Command line: tokenmill generate | chat | serve | run-batch | bench | models | plan | info."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import TYPE_CHECKING

from tokenmill.engine.engine_args import add_engine_args, engine_kwargs
from tokenmill.settings import parse_args

if TYPE_CHECKING:
    from tokenmill.sampling_params import SamplingParams

EXAMPLE_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a GPU is in one sentence.",
    "List three prime numbers.",
]


# What the CLI uses for a sampling flag the user leaves out when the model's generation_config.json
# (see --generation-config) does not set it either: short greedy answers.
CLI_SAMPLING_DEFAULTS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0}


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    fallback = ", ".join(f"{name}={value}" for name, value in CLI_SAMPLING_DEFAULTS.items())
    group = parser.add_argument_group(
        "sampling",
        f"flags left out take the model's generation_config.json values (see --generation-config), else {fallback}",
    )
    group.add_argument("--max-tokens", type=int, default=None)
    group.add_argument("--temperature", type=float, default=None)
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)


def _sampling_params(args: argparse.Namespace, model_defaults: dict[str, float | int]) -> SamplingParams:
    from tokenmill.sampling_params import SamplingParams, with_defaults

    explicit = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
    }
    return SamplingParams(**with_defaults(explicit, model_defaults, CLI_SAMPLING_DEFAULTS))


def cmd_generate(args: argparse.Namespace) -> None:
    from tokenmill import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = _sampling_params(args, llm.config.model.sampling_defaults)
    prompts = args.prompts or EXAMPLE_PROMPTS
    start = time.perf_counter()
    if args.raw or llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    print(
        f"\n{len(outputs)} requests, {num_in} prompt + {num_out} generated tokens in {elapsed:.2f} s: "
        f"{num_out / elapsed:.1f} output tok/s"
    )


def cmd_chat(args: argparse.Namespace) -> None:
    from tokenmill import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = _sampling_params(args, llm.config.model.sampling_defaults)
    history: list[dict[str, str]] = []
    print("tokenmill chat: type a message, an empty line or Ctrl-D to quit.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        reply = ""
        for out in llm.stream(history, params, chat=True):
            print(out.outputs[0].delta_text, end="", flush=True)
            reply += out.outputs[0].delta_text
        print()
        history.append({"role": "assistant", "content": reply})


def _add_unavailable_serve_parser(sub: argparse._SubParsersAction, missing: ModuleNotFoundError) -> None:
    """`serve` where the server's libraries are missing: it says which and how to get them."""
    serve = sub.add_parser("serve", help=f"unavailable here: {missing}")
    serve.add_argument("args", nargs=argparse.REMAINDER)

    def fail(args: argparse.Namespace) -> None:
        raise RuntimeError(f"tokenmill serve needs the server's libraries ({missing}); pip install -e . installs them")

    serve.set_defaults(func=fail)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="tokenmill", description="A high-throughput LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate for prompts (default: a few examples)")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--raw", action="store_true", help="no chat template, plain completion")
    gen.add_argument("prompts", nargs="*")
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive streaming chat")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    try:
        from tokenmill.server.cli import add_serve_parser
    except ModuleNotFoundError as exc:  # a library only the server uses (fastapi, ...): the rest still works
        if (exc.name or "").split(".")[0] == "tokenmill":
            raise
        _add_unavailable_serve_parser(sub, exc)
    else:
        from tokenmill.fleet.cli import add_fleet_args
        from tokenmill.server.run_batch_cli import add_run_batch_parser

        add_fleet_args(add_serve_parser(sub))
        add_run_batch_parser(sub)

    from tokenmill.bench.cli import add_bench_parser

    add_bench_parser(sub)

    from tokenmill.registry.cli import add_models_parser

    add_models_parser(sub)

    from tokenmill.planner.cli import add_plan_parser

    add_plan_parser(sub)

    from tokenmill.bench.hardware_info import add_info_parser

    add_info_parser(sub)

    args = parse_args(parser, argv)
    try:
        args.func(args)
    except (ValueError, RuntimeError) as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C (say during serve's start-up): no traceback, the shell's status for SIGINT
        sys.exit(130)


if __name__ == "__main__":
    main()

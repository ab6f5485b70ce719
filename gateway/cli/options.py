"""The options `flowprefill serve` and `worker` share, each defined once: the engine's, derived from
EngineConfig's fields (engine/core/config.py: the option's type, choices, default and help), and the
server's (the policy, the output parsers). `serve` hands them to its workers with `to_argv`.

Nothing here loads torch, so neither does parsing `serve`'s command line (the engine runs only in its
workers' processes): the policies' names come from engine/core/config.py, the output parsers' from
engine.serving.tool_calls and engine.serving.reasoning (torch-free, imported only by `add_server_options`). The
address options, which `flowprefill gateway` shares, are in common.py."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal

from engine.core.config import POLICIES, SMOLLM2, EngineConfig, ModelConfig, check_gguf, model_path, parse_policy
from gateway.cli.common import CommandLineError

# What `serve` and `worker` serve without --model: a real model, where in-process engines (EngineConfig)
# default to the tiny one.
SERVED_MODEL = SMOLLM2


def check_model(model: str) -> None:
    """--model names the tiny model, smollm2 (its package installed), a GGUF file (or a directory of one),
    or a Hugging Face checkpoint directory whose config.json FlowPrefill can run; the worker reads the
    weights (and a GGUF's metadata) when it loads them. Checked before anything starts, not when parsing:
    a command line can be read on a machine without the checkpoint (tests/test_docs.py does)."""
    try:
        path = model_path(model)
        if path is not None and path.suffix == ".gguf":
            check_gguf(path)
        elif path is not None:
            ModelConfig.from_dir(path)
    except (OSError, ValueError) as exc:
        raise CommandLineError(str(exc)) from None


def _kind(hint: Any) -> tuple[type, tuple[str, ...] | None]:
    """The argparse type of a field's annotation, and its choices when it is a Literal."""
    if typing.get_origin(hint) is Literal:
        return str, typing.get_args(hint)
    if typing.get_origin(hint) in (types.UnionType, typing.Union):  # X | None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _kind(inner)
    return hint, None


def add_engine_options(parser: argparse.ArgumentParser, served: bool = False) -> list[argparse.Action]:
    """One option per EngineConfig field the command line sets, its dest the field's name, its default the
    field's; `served` (serve and worker): --model's is SERVED_MODEL."""
    group = parser.add_argument_group("engine", "each engine worker's settings (EngineConfig, docs/engine.md)")
    hints = typing.get_type_hints(EngineConfig)
    actions = []
    for f in dataclasses.fields(EngineConfig):
        flag = f.metadata.get("flag", "")
        if flag is None:
            continue
        kind, choices = _kind(hints[f.name])
        how: dict[str, Any] = ({"action": argparse.BooleanOptionalAction} if kind is bool
                               else {"type": kind, "choices": choices,
                                     "metavar": "MODEL" if f.name == "model" else "N" if kind in (int, float)
                                     else None})
        default = SERVED_MODEL if f.name == "model" and served else f.default
        text = f.metadata["help"] + (f" (default: {default})" if f.name == "model" else "")
        actions.append(group.add_argument(flag or f"--{f.name.replace('_', '-')}", dest=f.name, default=default,
                                          help=text, **how))
    return actions


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the options parsed into (fields without an option keep their defaults)."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                           if hasattr(args, f.name)})


def add_server_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """What an engine worker's server does with requests: the prefill policy, the output parsers."""
    from engine.serving import reasoning, tool_calls  # torch-free: the parsers' names

    def policy(name: str) -> str:
        try:
            parse_policy(name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return name

    group = parser.add_argument_group("server", "how each engine worker serves requests")
    return [
        group.add_argument("--policy", default="flowprefill", type=policy, metavar="POLICY",
                           help=f"prefill scheduling policy: {' | '.join(POLICIES)} (N: chunk tokens)"),
        group.add_argument("--tool-call-parser", choices=tool_calls.PARSERS, default=None,
                           help="serve chat requests with tools (tool_choice auto), reading the model's calls in "
                                "this format: hermes (Qwen2.5, Hermes, the tiny model's template), "
                                "llama3_json (Llama 3.1); without it such requests are refused"),
        group.add_argument("--reasoning-parser", choices=reasoning.PARSERS, default=None,
                           help="a reasoning model's: its <think> reasoning comes back apart from the content "
                                "(reasoning_content), and a structured output applies after it"),
    ]


def worker_options() -> list[argparse.Action]:
    """The options a worker takes that `serve` passes on to each of its workers."""
    parser = argparse.ArgumentParser()
    return add_server_options(parser) + add_engine_options(parser, served=True)


def to_argv(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The command-line words that give these options their values in `args` (defaults left out)."""
    argv: list[str] = []
    for action in actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0 if value else 1])  # --prefix-caching / --no-prefix-caching
        else:
            argv += [action.option_strings[0], str(value)]
    return argv

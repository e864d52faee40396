"""``python -m keyfold <command>``: one entry point, each command lives in its own module.

Commands are imported lazily so ``python -m keyfold tour`` never imports the Transformer.
A command whose extra is not installed prints the ``pip install`` line to run; its ``--help``
works without any extra.
"""

from __future__ import annotations

import importlib
import sys

from ._extras import EXTRAS, MissingExtra, help_stubs, missing

# command words -> ("module:function", help, extra or None); the function takes the remaining argv.
COMMANDS = {
    ("tour",): ("keyfold.tour:main", "every variant through one engine, checked and timed", None),
    ("plan",): ("keyfold.tour:plan_main", "draw the block plan of a preset mask", None),
    ("bench", "kernels"): ("keyfold.bench.kernels:main", "CPU kernels vs SDPA and compiled FlexAttention", "plot"),
    ("bench", "decode"): ("keyfold.bench.decode:main", "KV-cache decoding, paged, cascade, window cache", "plot"),
    ("bench", "memory"): ("keyfold.bench.memory:main", "peak memory of forward+backward, keyfold vs SDPA", None),
    ("bench", "scaling"): ("keyfold.bench.scaling:main", "time vs N from 1k to 128k tokens, fitted exponents",
                           "plot"),
    ("bench", "toolbox"): ("keyfold.apps.toolbox.bench:main", "attention beside GRU/LSTM/TCN/linear attention/S4D",
                           "toolbox"),
    ("bench", "compile"): ("keyfold.bench.compile:main", "torch.compile: a small Llama train step, keyfold vs SDPA",
                           None),
    ("bench", "gpu"): ("keyfold.bench.gpu:main", "the Triton kernel vs SDPA-flash and compiled Flex on a GPU",
                       "triton"),
    ("costs",): ("keyfold.distributed.costs:main", "context-parallel cost model table", "plot"),
    ("train", "translate"): ("keyfold.apps.translate.train:main", "train the Transformer on German-English",
                             "translate"),
    ("train", "compare"): ("keyfold.apps.translate.compare:main",
                           "Table 2: keyfold vs torch.nn Transformer vs GRU+attention at one budget", "translate"),
    ("translate",): ("keyfold.apps.translate.translate:main",
                     "translate with a checkpoint, or evaluate on the test split", "translate"),
    ("verify",): ("keyfold.apps.verify.report:main", "error bounds, certified bounds, streaming, fuzzing", "verify"),
    ("verify", "faults"): ("keyfold.apps.verify.faults:main", "fuzz count per module: inputs, errors, wrong answers",
                           "verify"),
    ("control", "bench"): ("keyfold.apps.control.bench:main", "predictors in a safe real-time closed loop",
                           "control"),
}


def _usage() -> str:
    lines = ["usage: python -m keyfold <command> [options]", "", "commands:"]
    for words, (_, help_, extra) in COMMANDS.items():
        need = f"  [keyfold[{extra}]]" if extra else ""
        lines.append(f"  {' '.join(words):<18} {help_}{need}")
    return "\n".join(lines)


def _wants_help(argv: list[str]) -> bool:
    return "-h" in argv or "--help" in argv


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(_usage())
        return 0
    for n in (2, 1):
        words = tuple(argv[:n])
        if words not in COMMANDS:
            continue
        target, _, extra = COMMANDS[words]
        mod, fn = target.split(":")
        rest = argv[n:]
        absent = missing(extra) if extra else []
        if absent and _wants_help(rest):
            print(f"(keyfold[{extra}] is not installed: pip install 'keyfold[{extra}]' before running "
                  f"`{' '.join(words)}`)\n", file=sys.stderr)
            with help_stubs():
                return int(getattr(importlib.import_module(mod), fn)(rest) or 0)
        if absent:
            print(f"`python -m keyfold {' '.join(words)}` needs {', '.join(absent)}: "
                  f"run  pip install 'keyfold[{extra}]'", file=sys.stderr)
            return 1
        try:
            result = getattr(importlib.import_module(mod), fn)(rest)
        except MissingExtra as err:
            print(err, file=sys.stderr)
            return 1
        return int(result or 0)
    print(_usage(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

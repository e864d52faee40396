"""``python -m keyfold <command>``: one entry point, each command lives in its own module.

Commands are imported lazily so ``python -m keyfold tour`` never imports the Transformer.
"""

from __future__ import annotations

import importlib
import sys

# command words -> "module:function"; the function takes the remaining argv list.
COMMANDS = {
    ("tour",): ("keyfold.tour:main", "every variant through one engine, checked and timed"),
    ("plan",): ("keyfold.tour:plan_main", "draw the block plan of a preset mask"),
    ("bench", "kernels"): ("keyfold.bench.kernels:main", "CPU kernels vs SDPA and compiled FlexAttention"),
    ("bench", "decode"): ("keyfold.bench.decode:main", "KV-cache decoding, paged, cascade, window cache"),
    ("bench", "toolbox"): ("keyfold.apps.toolbox.bench:main", "attention beside GRU/LSTM/TCN/linear attention/S4D"),
    ("costs",): ("keyfold.distributed.costs:main", "context-parallel cost model table"),
    ("train", "translate"): ("keyfold.apps.translate.train:main", "train the Transformer on German-English"),
    ("translate",): ("keyfold.apps.translate.translate:main", "translate with a checkpoint, or evaluate on the test split"),
    ("verify",): ("keyfold.apps.verify.report:main", "error bounds, certified bounds, streaming, fuzzing"),
    ("verify", "faults"): ("keyfold.apps.verify.faults:main", "fuzz count per module: inputs, errors, wrong answers"),
    ("control", "bench"): ("keyfold.apps.control.bench:main", "predictors in a safe real-time closed loop"),
}


def _usage() -> str:
    lines = ["usage: python -m keyfold <command> [options]", "", "commands:"]
    for words, (_, help_) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<18} {help_}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for n in (2, 1):
        words = tuple(argv[:n])
        if words in COMMANDS:
            target = COMMANDS[words][0]
            mod, fn = target.split(":")
            result = getattr(importlib.import_module(mod), fn)(argv[n:])
            return int(result or 0)
    print(_usage(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Run configs: TrainConfig, and loading a config file with `--key=value` overrides into the config dataclasses.

A config file is plain Python that assigns fields of ModelConfig (model.py), TrainConfig (below) or, for
finetune.py, FinetuneConfig; every other field keeps its default. Config files are code: running one runs
whatever it contains, so run only config files you trust. `--key=value` overrides are type-checked, and an
unknown key is an error (with a suggestion). Each dataclass checks every field against its allowed values
when it is made (TrainConfig.__post_init__ and check_ranges below; ModelConfig's in model.py), so a nonsense
value fails with its name, its value and what is allowed before anything is built. Every such mistake is a
ConfigError (a cli.UserError): one line for the user, no traceback.
"""
from __future__ import annotations

import ast
import difflib
import math
import os
import runpy
import sys
import textwrap
from dataclasses import dataclass, fields
from typing import Callable, TypeVar

from infra import cli
from infra.distributed import COMPILE_MODES, COMPILE_REGIONS, PARALLEL, PRECISIONS
from model import ModelConfig

C = TypeVar("C")
WEIGHT_DECAY_ON = ("matrices", "all")
TYPES = {"int": int, "float": float, "bool": bool, "str": str}  # the annotations config fields use, "T" or "T | None"


class ConfigError(cli.UsageError):
    """A config file's value or `--key=value` override that is not allowed: an unknown key, a value of the wrong
    type or outside its allowed values, or settings that do not fit together (a ValueError too)."""


@dataclass
class TrainConfig:
    data: str = "shakespeare"       # "shakespeare" (embedded corpus, prepared on first use) or a shard directory
    out_dir: str = "out/run"
    seed: int = 0
    batch_size: int = 16            # sequences per optimizer step, over all ranks
    micro_batch_size: int = 0       # sequences per forward on one rank; 0: batch_size / world size
    seq_len: int = 128
    max_steps: int = 1000
    lr: float = 6e-4
    min_lr_ratio: float = 0.1       # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1       # AdamW's, on the parameters weight_decay_on names
    weight_decay_on: str = "matrices"  # "matrices" (embedding included; never norms or routers) | "all" (every
                                    # parameter: the authors' code); train.param_groups
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0          # 0 disables clipping
    eval_interval: int = 200
    eval_batches: int = 20          # validation batches of batch_size sequences: the same windows every time
    log_interval: int = 20
    ckpt_interval: int = 0          # also save every this many steps (0: off)
    ckpt_minutes: float = 30.0      # save when this much time has passed since the last save (0: off)
    keep_checkpoints: int = 2       # keep the newest K checkpoints in out_dir
    max_bad_steps: int = 3          # stop after this many steps in a row with a non-finite loss or gradient
    time_budget_s: float = 0.0      # > 0: stop at this wall-clock budget (all ranks at the same step), then evaluate
    device: str = "auto"            # "auto" | "cpu" | "cuda"
    dist_timeout_s: float = 600.0   # under torchrun: a rank waiting this long for the others ends the run
    resume: bool = False            # continue from the newest intact checkpoint in out_dir
    parallel: str = "ddp"           # "ddp" (replicas) | "fsdp" (FSDP2, sharded checkpoints); one process: plain
    compile: bool = False           # torch.compile the model, in the regions compile_regions names
    compile_regions: str = "sublayers"  # "sublayers" (each attention, MLP and norm) | "model" (the whole forward)
    compile_mode: str = "default"   # | "reduce-overhead" (CUDA graphs: one process or DDP; docs/training.md)
    compile_backend: str = "inductor"  # torch.compile's backend ("aot_eager" traces without generating code)
    precision: str = "auto"         # "auto" (bf16 on CUDA, fp32 on CPU) | "bf16" | "fp32" | "bf16-params" (the
                                    # whole model in bf16: the authors' code): distributed.py's rule
    activation_checkpointing: bool = False  # recompute each sublayer in backward
    adamw: str = "auto"             # "auto" (fused on CUDA, torch's per-tensor loop on a CPU) | "fused" | "loop"
    peak_flops: float = 989e12      # per device, for MFU: H100 SXM dense bf16
    wandb: bool = False             # also log to Weights & Biases (needs `pip install wandb`)
    wandb_project: str = "delta-attnres"

    def __post_init__(self):
        check_ranges(self, TRAIN_RANGES)


# ----------------------------------------------------------------------------------------------- config

Rule = tuple[Callable[[object], bool], str]  # (test of a value, the allowed values in words)


def one_of(names: tuple[str, ...]) -> Rule:
    return (lambda v: v in names, ", ".join(names))


AT_LEAST_1: Rule = (lambda v: v >= 1, "integers >= 1")
NON_NEGATIVE: Rule = (lambda v: 0 <= v < math.inf, "finite numbers >= 0")  # `0 <= v` is False for NaN too
AT_LEAST_0: Rule = (lambda v: v >= 0, "integers >= 0")
POSITIVE: Rule = (lambda v: 0 < v < math.inf, "finite numbers > 0")
NAME: Rule = (lambda v: v.strip() != "", "non-empty strings")
TRAIN_RANGES: dict[str, Rule] = {
    "data": (NAME[0], "'shakespeare' or a shard directory"), "out_dir": NAME, "wandb_project": NAME,
    "seed": AT_LEAST_0, "batch_size": AT_LEAST_1, "seq_len": AT_LEAST_1, "max_steps": AT_LEAST_0,
    "micro_batch_size": (AT_LEAST_0[0], "0 (batch_size / world size) or integers >= 1"),
    "warmup_steps": AT_LEAST_0, "eval_interval": AT_LEAST_1, "eval_batches": AT_LEAST_1,
    "log_interval": AT_LEAST_1, "ckpt_interval": (AT_LEAST_0[0], "0 (off) or integers >= 1"),
    "keep_checkpoints": (AT_LEAST_1[0], "integers >= 1 (--resume needs a checkpoint)"),
    "max_bad_steps": AT_LEAST_1, "lr": POSITIVE, "peak_flops": POSITIVE, "dist_timeout_s": POSITIVE,
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "numbers in [0, 1]"), "weight_decay": NON_NEGATIVE,
    "beta1": (lambda v: 0 <= v < 1, "numbers in [0, 1)"), "beta2": (lambda v: 0 <= v < 1, "numbers in [0, 1)"),
    "grad_clip": (NON_NEGATIVE[0], "finite numbers >= 0 (0: no clipping)"),
    "ckpt_minutes": (NON_NEGATIVE[0], "finite numbers >= 0 (0: off)"),
    "time_budget_s": (NON_NEGATIVE[0], "finite numbers >= 0 (0: no budget)"),
    "device": one_of(("auto", "cpu", "cuda")), "parallel": one_of(PARALLEL), "precision": one_of(PRECISIONS),
    "compile_backend": NAME, "compile_regions": one_of(COMPILE_REGIONS),
    "compile_mode": one_of(COMPILE_MODES), "weight_decay_on": one_of(WEIGHT_DECAY_ON),
    "adamw": one_of(("auto", "fused", "loop")),
}


def check_ranges(cfg, ranges: dict[str, Rule]) -> None:
    """The one validation of a config dataclass: every field in `ranges` against its allowed values."""
    for key, (allowed, words) in ranges.items():
        value = getattr(cfg, key)
        if not allowed(value):
            raise ConfigError(f"{key}={value!r}: allowed values are {words}")


def field_type(annotation: str) -> tuple[type, bool]:
    """(the type, whether None is allowed) of a field annotated "T" or "T | None"."""
    name, _, rest = annotation.partition(" | ")
    return TYPES.get(name, name), rest == "None"


BOOL_WORDS = ("1", "true", "yes", "0", "false", "no")


def command_line(argv: list[str], prog: str, classes: tuple = (ModelConfig, TrainConfig)) -> tuple:
    """load_config for a script's command line: -h or --help prints the usage with every key and its default
    (exit 0); no arguments at all print the usage (exit 2) rather than start a run of the defaults."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage(prog, classes, keys=True))
        raise SystemExit(0)
    if not argv:
        print(usage(prog, classes, keys=False), file=sys.stderr)
        raise SystemExit(2)
    return load_config(argv, classes)


def usage(prog: str, classes: tuple, keys: bool) -> str:
    """The usage text: the arguments, where the configs are, and (keys) every key with its default."""
    text = (f"usage: python {prog} CONFIG.py [--key=value ...]\n\n"
            "CONFIG.py is a Python file of `key = value` lines (configs/ holds the project's; docs/training.md "
            "says what they run);\n--key=value (or --key value) overrides one key after it. "
            + ("The keys, with their defaults:" if keys else f"`python {prog} --help` lists the keys."))
    if keys:
        for cls in classes:
            text += f"\n\n{cls.__name__}:\n" + textwrap.fill(
                ", ".join(f"{f.name}={getattr(cls(), f.name)!r}" for f in fields(cls)), 118,
                initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)
    return text


def _parse_value(key: str, text: str, typ: type, optional: bool):
    if optional and text == "None":
        return None
    if typ is bool:
        if text.lower() in BOOL_WORDS[:3] + ("",):
            return True
        if text.lower() in BOOL_WORDS[3:]:
            return False
        raise ConfigError(f"--{key}={text}: expected a bool (true/false)")
    if typ is str:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"--{key}={text}: expected {typ.__name__}{' or None' if optional else ''}") from None
    return value


def _check_type(key: str, value, typ: type, optional: bool):
    if optional and value is None:
        return None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        expected = f"{typ.__name__}{' or None' if optional else ''}"
        raise ConfigError(f"config key {key!r} = {value!r}: expected {expected}, got {type(value).__name__}")
    return value


def load_config(argv: list[str], classes: tuple = (ModelConfig, TrainConfig)) -> tuple:
    """argv: [CONFIG.py] [--key=value ...] -> one instance per dataclass in `classes`, each field type-checked;
    a key that belongs to none of them is an error."""
    owner = {f.name: cls for cls in classes for f in fields(cls)}
    types = {f.name: field_type(f.type) for cls in classes for f in fields(cls)}
    values: dict[str, object] = {}
    args = list(argv)
    if args and not args[0].startswith("--"):
        path = args.pop(0)
        if not os.path.isfile(path):
            raise cli.NotFoundError(f"config file not found: {path}")
        namespace = runpy.run_path(path)
        values.update({k: v for k, v in namespace.items()
                       if not k.startswith("_") and not callable(v) and not isinstance(v, type(os))})
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: write overrides as --key=value (the config file, if "
                              "any, comes first)")
        key, equals, text = arg[2:].partition("=")
        if key not in types:
            raise _unknown(key, types)
        is_bool = types[key][0] is bool
        if not equals and args and not args[0].startswith("--") and (not is_bool or args[0].lower() in BOOL_WORDS):
            text = args.pop(0)            # --key value, as --key=value
        elif not equals and not is_bool:
            raise ConfigError(f"--{key} needs a value: write --{key}=VALUE")
        values[key] = _parse_value(key, text, *types[key])
    for key in values:
        if key not in types:
            raise _unknown(key, types)
    values = {k: _check_type(k, v, *types[k]) for k, v in values.items()}
    return tuple(checked(cls, {k: v for k, v in values.items() if owner[k] is cls}) for cls in classes)


def checked(cls: Callable[..., C], values: dict, where: str = "") -> C:
    """cls(**values), where a ValueError of its checks is the user's mistake: ModelConfig (model.py, library
    code) raises ValueError, which becomes a ConfigError with the same message, after `where` if given (e.g. the
    checkpoint whose model_config it is)."""
    try:
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{where}{e}") from None


def _unknown(key: str, types: dict) -> ConfigError:
    close = difflib.get_close_matches(key, types, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def batch_split(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """(micro-batch per rank, gradient accumulation steps) on world_size processes, or a clear error."""
    if cfg.parallel == "fsdp" and world_size == 1:
        raise ConfigError("parallel='fsdp' on a single process shards nothing: launch with "
                          "`torchrun --nproc_per_node=N train.py ...` (N >= 2) or set parallel='ddp'")
    if not cfg.micro_batch_size:
        if cfg.batch_size % world_size:
            raise ConfigError(f"batch_size={cfg.batch_size} does not split over {world_size} processes: launch a "
                              f"number of processes that divides it, or set micro_batch_size")
        return cfg.batch_size // world_size, 1
    per_micro_step = cfg.micro_batch_size * world_size
    if cfg.batch_size % per_micro_step:
        raise ConfigError(f"batch_size={cfg.batch_size} is not a multiple of micro_batch_size={cfg.micro_batch_size} "
                          f"x world_size={world_size} = {per_micro_step}: change micro_batch_size or the number of "
                          f"processes so that it divides the global batch")
    return cfg.micro_batch_size, cfg.batch_size // per_micro_step

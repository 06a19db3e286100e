#!/usr/bin/env python3
"""Train BatchPPO on a task from configs/.

  python train.py --config halfcheetah
  python train.py --config pendulum --logdir logs/pendulum --set ppo.policy_lr=3e-4

Running again with an existing --logdir resumes that run from its latest
checkpoint, with the config saved there; --steps N (unlike --set) may then
raise its budget to train a finished run further:

  python train.py --config pendulum --logdir logs/pendulum --steps 600000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path


def _config_help() -> str:
    from batchrl.config import Config, available_configs
    lines = [f"available configs: {', '.join(available_configs())}", "",
             "config keys (--set section.key=value; values are TOML: 3e-4, true, [64, 64], \"Hopper-v5\"):"]
    for section in dataclasses.fields(Config):
        default = section.default_factory()
        for field in dataclasses.fields(default):
            if section.name == "ppo" and field.name == "max_length":
                continue
            value = _toml(getattr(default, field.name))
            lines.append(f"  {section.name}.{field.name} = {value}")
    return "\n".join(lines)


def _toml(value: object) -> str:
    """A default as --set takes it (TOML), e.g. true, "CartPole-v1", [200, 100]."""
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_toml(item)}" for key, item in value.items()) + "}"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=_config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="a name from configs/ (e.g. halfcheetah) or a path to a .toml file")
    parser.add_argument("--logdir", type=Path, default=None,
                        help="where to write the run (default: logs/CONFIG-YYYYmmdd-HHMMSS); "
                             "an existing run there is resumed")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key, e.g. ppo.discount=0.98")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="training budget in env steps (train.steps); unlike --set also "
                             "allowed when resuming, to train a run further")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    # "package.module:function" env ids may name a module in the current
    # directory, as with `python -m` (a script only gets its own directory).
    if os.getcwd() not in sys.path:
        sys.path.insert(1, os.getcwd())

    from batchrl.config import ConfigError, load_config
    from batchrl.envs.factory import EnvSpecError
    from batchrl.trainer import CONFIG_FILE, Trainer, load_saved_config

    steps = [] if args.steps is None else [f"train.steps={args.steps}"]
    try:
        if args.logdir is not None and (args.logdir / CONFIG_FILE).exists():
            if args.overrides:
                raise ConfigError(f"{args.logdir} holds a run, which resumes with its saved "
                                  f"config; drop --set (--steps N may raise its budget) or "
                                  f"choose a new --logdir")
            config = load_saved_config(args.logdir, steps)
        else:
            config = load_config(args.config, args.overrides + steps)
        logdir = args.logdir or Path("logs") / f"{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        print(f"Training {config.env.id} with {config.env.num_agents} agents for "
              f"{config.train.steps:,} steps; writing to {logdir}")
        result = Trainer(config, logdir, progress=not args.no_progress).run()
    except (ConfigError, EnvSpecError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result:
        print(f"Final evaluation: {result['score']:.1f} ± {result['score_std']:.1f} "
              f"over {result['episodes']} episodes (mean action)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Train BatchPPO on a task from configs/.

  python train.py --config halfcheetah
  python train.py --config pendulum --logdir logs/pendulum --set ppo.policy_lr=3e-4

Running again with an existing --logdir resumes that run from its latest
checkpoint, with the config saved there.
"""

from __future__ import annotations

import argparse
import dataclasses
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
            lines.append(f"  {section.name}.{field.name} = {getattr(default, field.name)!r}")
    return "\n".join(lines)


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
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from batchrl.config import ConfigError, load_config
    from batchrl.envs.factory import EnvSpecError
    from batchrl.trainer import CONFIG_FILE, Trainer, load_saved_config

    try:
        if args.logdir is not None and (args.logdir / CONFIG_FILE).exists():
            if args.overrides:
                raise ConfigError(f"{args.logdir} holds a run, which resumes with its saved "
                                  f"config; drop --set or choose a new --logdir")
            config = load_saved_config(args.logdir)
        else:
            config = load_config(args.config, args.overrides)
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

"""train.py's configuration outside train.py: conf/ composed with Hydra overrides, for the tools that build its
DataModule or run its training (the evaluator and calibration, the loader and app benchmarks)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lkcnn.errors import one_line

from .errors import ConfigError

# conf/ ships with the source tree (a checkout or an editable install), beside the lkcnn package
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_train(overrides: Sequence[str]) -> Any:
    """conf/train.yaml composed with `overrides`, as `python train.py ...` would run it."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def compose_checked(overrides: Sequence[str]) -> Any:
    """compose_train for the tools that take train.py's overrides: overrides that do not compose are a ConfigError
    in one line (command_line_error's), as train.py reports them."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose_train(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(command_line_error(overrides) or one_line(err)) from None


def command_line_error(args: Sequence[str]) -> str | None:
    """One line, with the closest names, for train.py overrides that cannot compose (a misspelled key, a config option
    that does not exist), also in a multirun (`-m`: each sweep's first value stands for it); None when they compose,
    and for command lines left to Hydra (its other flags, errors of other kinds). Hydra's own report of these spans
    several lines and offers `+key=value` for a typo."""
    import difflib
    import re

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf import DictConfig, OmegaConf

    if any(arg.startswith("-") and arg not in ("-m", "--multirun") for arg in args):
        return None
    try:
        # a sweep composes one job per value: its first shows a misspelled key or option as well as any
        overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
        args = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
                else o.input_line for o in overrides]
        compose_train(args)
        return None
    except MissingConfigException as err:  # "Could not find 'model/replknet_tinyy'"
        found = re.search(r"Could not find '([^']+)/([^'/]+)'", str(err))
        options = sorted(p.stem for p in (CONF_DIR / found[1]).glob("*.yaml")) if found else []
        if not options:
            return str(err).strip().splitlines()[0]
        close = difflib.get_close_matches(found[2], options, n=2, cutoff=0.7)
        hint = f"; did you mean {' or '.join(close)}?" if close else "."
        return f"{found[1]}={found[2]} is not one of the {found[1]} configs ({', '.join(options)}){hint}"
    except ConfigCompositionException as err:
        key = getattr(err.__cause__, "full_key", None)
        twice = re.match(r"Multiple values for (\S+)\.", str(err))
        if twice:  # `+group=option` for a group the config already chooses from
            return f"{twice[1]} already has a config: choose another with {twice[1]}=... (no +)"
        if not key:
            return one_line(err)
        parent, _, leaf = key.rpartition(".")
        rest = [a for a in args if a.lstrip("+~").split("=", 1)[0] != key]
        node = OmegaConf.select(compose_train(rest), parent) if parent else compose_train(rest)
        names = [f"{parent}.{k}" if parent else str(k) for k in node] if isinstance(node, DictConfig) else []
        close = difflib.get_close_matches(key, names, n=2, cutoff=0.7)
        hint = f": did you mean {' or '.join(close)}?" if close else "."
        return (f"{key} is not a setting of this config{hint} (`python train.py --cfg job` prints them all; "
                f"+{key}=... adds a new key)")
    except Exception:  # anything else is Hydra's to report, as it would without this check
        return None

"""The search space of one cell: which (variant, params) configurations exist and how a trial
suggests one, define-by-run (the variant first, then that variant's own tunables)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import optuna
import optuna.distributions as od

from fusionlab.registry import Params, TunableSpace, Variant
from fusionlab.search.optuna_adapter import frozen


@dataclass(frozen=True)
class Config:
    """One point of the space: a variant and values for its tunables."""

    variant: str
    params: tuple[tuple[str, Any], ...]

    @property
    def key(self) -> str:
        """A stable identity, stored with each trial so a resumed sweep skips it."""
        return json.dumps({"variant": self.variant, "params": dict(self.params)}, sort_keys=True)

    def as_params(self) -> Params:
        return dict(self.params)


def make_config(variant: str, params: Mapping[str, Any]) -> Config:
    return Config(variant, tuple(sorted(params.items())))


def config_of_key(key: str) -> Config:
    """The configuration a `Config.key` stands for."""
    data = json.loads(key)
    return make_config(data["variant"], data["params"])


def _distribution(space: TunableSpace) -> od.BaseDistribution:
    if isinstance(space, (od.IntDistribution, od.FloatDistribution)):
        return space
    return od.CategoricalDistribution(list(space))


class CellSpace:
    """The variants that can run in one cell and the Optuna parameter names they map to.

    Optuna refuses a parameter whose choices differ from earlier trials of the same study, so a
    parameter whose choices changed since (a new plugin, new tunable values) gets a suffixed name.
    """

    def __init__(self, variants: list[Variant], study: optuna.Study) -> None:
        self.variants = {v.name: v for v in variants}
        known: dict[str, od.BaseDistribution] = {}
        for trial in study.get_trials(deepcopy=False):
            known.update(trial.distributions)
        self._names: dict[str, str] = {}
        self._dists: dict[str, od.BaseDistribution] = {}
        self._bind("variant", od.CategoricalDistribution(sorted(self.variants)), known)
        for variant in variants:
            for tunable, space in variant.tunables.items():
                self._bind(f"{variant.name}.{tunable}", _distribution(space), known)

    def _bind(
        self, base: str, dist: od.BaseDistribution, known: Mapping[str, od.BaseDistribution]
    ) -> None:
        name = base
        if base in known and known[base] != dist:
            name = f"{base}#{hashlib.sha1(repr(dist).encode()).hexdigest()[:6]}"
        self._names[base], self._dists[base] = name, dist

    def enqueue_params(self, config: Config) -> dict[str, Any]:
        """The Optuna params that make a trial pick exactly this config."""
        fixed = {self._names["variant"]: config.variant}
        for tunable, value in config.params:
            fixed[self._names[f"{config.variant}.{tunable}"]] = value
        return fixed

    def replay(self, trial: optuna.Trial, key: str) -> Config:
        """The configuration an enqueued trial stands for (its key), its values recorded as the
        trial's params when the enqueuer used this space's parameter names. Another plan of the
        cell (other variants) may have named them otherwise, or bound a name to other choices
        first, which Optuna refuses: then the params stay unrecorded (the record has them)."""
        config = config_of_key(key)
        fixed = frozen(trial).system_attrs.get("fixed_params") or {}
        if set(self.enqueue_params(config)) <= set(fixed):
            with contextlib.suppress(ValueError):  # "does not support dynamic value space"
                self.suggest(trial)
        return config

    def suggest(self, trial: optuna.Trial) -> Config:
        """Define-by-run: choose the variant, then only that variant's tunables."""
        variant = _suggest(trial, self._names["variant"], self._dists["variant"])
        params = {
            tunable: _suggest(
                trial, self._names[f"{variant}.{tunable}"], self._dists[f"{variant}.{tunable}"]
            )
            for tunable in self.variants[variant].tunables
        }
        return make_config(variant, params)


def _suggest(trial: optuna.Trial, name: str, dist: od.BaseDistribution) -> Any:
    if isinstance(dist, od.IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    if isinstance(dist, od.FloatDistribution):
        return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
    assert isinstance(dist, od.CategoricalDistribution)
    return trial.suggest_categorical(name, list(dist.choices))

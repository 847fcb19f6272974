"""Where `--model` comes from: a tiny preset, a local transformers folder (its config, and its
weights when it has them), or `module:function` (any factory returning an `nn.Module`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusionlab.errors import UserError
from fusionlab.model.configs import config_fields, factory_parameters, typed_overrides
from fusionlab.model.memory import check_weights_fit
from fusionlab.model.models import (
    MODEL_NAMES,
    quiet_transformers,
    random_causal_lm,
    tiny_config,
    tiny_config_class,
)

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


class ModelSource:
    """How to make one model: `spec` is what the capture's recipe records to make it again."""

    spec: str

    def typed(self, raw: dict[str, str]) -> dict[str, Any]:
        """`--config` values typed from what the model is made from."""
        raise NotImplementedError

    def build(self, overrides: dict[str, Any], dtype: torch.dtype | None, seed: int) -> nn.Module:
        """The model in eval mode; its size checked against the memory available first."""
        raise NotImplementedError


class PresetSource(ModelSource):
    """One of fusionlab's tiny transformers models, random weights."""

    def __init__(self, name: str) -> None:
        self.spec = name

    def typed(self, raw: dict[str, str]) -> dict[str, Any]:
        config_class = tiny_config_class(self.spec)
        return typed_overrides(raw, config_fields(config_class), config_class.__name__)

    def build(self, overrides: dict[str, Any], dtype: torch.dtype | None, seed: int) -> nn.Module:
        config = tiny_config(self.spec, overrides)
        check_weights_fit(config, dtype or torch.float32)
        return random_causal_lm(config, dtype or torch.float32, seed)


class FolderSource(ModelSource):
    """A folder written by `save_pretrained`: config.json, and the weights if it holds them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder.resolve()
        self.spec = str(self.folder)
        if not (self.folder / "config.json").is_file():
            raise UserError(
                f"--model {str(folder)!r}: the folder has no config.json; give a folder written "
                "by save_pretrained (config only is enough: random weights)"
            )

    @property
    def has_weights(self) -> bool:
        return any((self.folder / name).is_file() for name in _WEIGHT_FILES)

    def _config(self, overrides: dict[str, Any] | None = None) -> Any:
        from transformers import AutoConfig

        try:
            with quiet_transformers():
                return AutoConfig.from_pretrained(self.folder, local_files_only=True,
                                                  **(overrides or {}))
        except Exception as error:  # a config transformers cannot read, or bad overrides
            raise UserError(f"--model {self.spec}: config.json {_one_line(error)}") from None

    def typed(self, raw: dict[str, str]) -> dict[str, Any]:
        config_class = type(self._config())
        return typed_overrides(raw, config_fields(config_class), config_class.__name__)

    def build(self, overrides: dict[str, Any], dtype: torch.dtype | None, seed: int) -> nn.Module:
        from transformers import AutoModelForCausalLM

        config = self._config(overrides)
        check_weights_fit(config, dtype or torch.float32)
        if not self.has_weights:
            return random_causal_lm(config, dtype or torch.float32, seed)
        try:
            with quiet_transformers():
                model = AutoModelForCausalLM.from_pretrained(
                    self.folder, config=config, dtype=dtype or torch.float32,
                    local_files_only=True,
                )
        except Exception as error:  # weights that do not load (or do not match --config)
            if "mismatched_sizes" in str(error):
                raise UserError(
                    f"--model {self.spec}: its weights do not have the sizes --config sets; drop "
                    "the size settings, or use a folder with config.json alone (random weights)"
                ) from None
            raise UserError(
                f"--model {self.spec}: loading its weights {_one_line(error)}"
            ) from None
        return model.eval()


class FactorySource(ModelSource):
    """`module:function` or `file.py:function`: a function returning an `nn.Module`; `--config`
    values become its keyword arguments, typed from its signature."""

    def __init__(self, spec: str) -> None:
        self.function = load_function(spec, "--model")
        self.spec = function_spec(spec)

    def typed(self, raw: dict[str, str]) -> dict[str, Any]:
        fields, open_ended = factory_parameters(self.function)
        return typed_overrides(raw, fields, f"{self.spec}()", open_ended)

    def build(self, overrides: dict[str, Any], dtype: torch.dtype | None, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = call_user_function(self.function, self.spec, **overrides)
        if not isinstance(model, nn.Module):
            raise UserError(
                f"--model {self.spec} returned {type(model).__name__}, not a torch.nn.Module: "
                "return the model"
            )
        return (model.to(dtype) if dtype is not None else model).eval()


def open_source(spec: str) -> ModelSource:
    """The source `--model` names: a preset, a folder, or module:function."""
    if spec in MODEL_NAMES:
        return PresetSource(spec)
    if Path(spec).is_dir():
        return FolderSource(Path(spec))
    if ":" in spec:
        return FactorySource(spec)
    if os.sep in spec or spec.startswith("."):
        raise UserError(f"--model {spec!r}: no such folder")
    raise UserError(
        f"unknown model {spec!r}: give {', '.join(MODEL_NAMES)}, a folder written by "
        "save_pretrained, or module:function (a factory returning an nn.Module)"
    )


def load_function(spec: str, option: str) -> Callable[..., Any]:
    """The function `module:function` or `path/file.py:function` names."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise UserError(f"{option} {spec!r}: write module:function or file.py:function")
    try:
        if where.endswith(".py") or os.sep in where:
            if not Path(where).is_file():
                raise UserError(f"{option} {spec!r}: no such file {where!r}")
            module = _module_from_file(Path(where))
        else:
            if os.getcwd() not in sys.path:  # `mymodels:build` imports from here, as in Python
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except UserError:
        raise
    except Exception as error:  # the user's module may raise anything on import
        raise UserError(
            f"{option} {spec!r}: importing {where} failed ({_one_line(error)})"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"{option} {spec!r}: {where} has no function {name!r}")
    return function


def function_spec(spec: str) -> str:
    """The spec with a file made absolute, so the recipe works from any folder."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        return f"{Path(where).resolve()}:{name}"
    return spec


def _module_from_file(path: Path) -> Any:
    module_name = f"fusionlab_model_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def call_user_function(function: Callable[..., Any], spec: str, *args: Any, **kwargs: Any) -> Any:
    """Call the user's function; whatever it raises becomes one line."""
    try:
        return function(*args, **kwargs)
    except UserError:
        raise
    except Exception as error:  # the user's code may raise anything
        raise UserError(f"{spec} raised {_one_line(error)}") from None


def example_inputs(spec: str, model: nn.Module) -> Any:
    """`--inputs module:function`: called with the model if it takes an argument, else bare."""
    function = load_function(spec, "--inputs")
    takes_model = bool(inspect.signature(function).parameters)
    return call_user_function(function, function_spec(spec), *((model,) if takes_model else ()))


def _one_line(error: BaseException) -> str:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__

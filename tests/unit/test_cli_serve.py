"""`swarmd run`'s --model, --layers and --no-model as the Config they build (no node runs)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest
from typer.testing import CliRunner

import swarmd.config
from swarmd.cli import app
from swarmd.config import Config, ServeSpec


class Captured(Exception):
    """Raised in place of starting the node, carrying the Config it would have run."""

    def __init__(self, config: Config) -> None:
        super().__init__("captured")
        self.config = config


@pytest.fixture(autouse=True)
def capture_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run` reads load_config from swarmd.config when called: stop it right after."""
    real = swarmd.config.load_config

    def load_and_stop(
        flags: Mapping[str, object], config_file: Path | None, env: Mapping[str, str]
    ) -> Config:
        raise Captured(real(flags, config_file, env))

    monkeypatch.setattr(swarmd.config, "load_config", load_and_stop)
    for name in list(os.environ):
        if name.startswith("SWARMD_"):
            monkeypatch.delenv(name)


def run_config(*args: str) -> Config:
    result = CliRunner().invoke(app, ["run", *args])
    assert isinstance(result.exception, Captured), result.output
    return result.exception.config


def run_error(*args: str) -> str:
    result = CliRunner().invoke(app, ["run", *args])
    assert result.exit_code == 2, result.output
    return result.output


def test_one_model_stays_the_flat_fields() -> None:
    config = run_config("--model", "m", "--layers", "0:4")
    assert (config.model, config.layers, config.serve) == ("m", "0:4", ())
    assert config.served() == (ServeSpec("m", "0:4"),)


def test_no_model_flag_is_the_defaults() -> None:
    config = run_config("--layers", "auto")
    assert (config.model, config.layers, config.serve) == (Config.model, "auto", ())


def test_two_models_with_two_layers_build_serve_in_order() -> None:
    config = run_config(
        "--model", "a", "--layers", "0:4", "--model", "b", "--layers", "4:8", "--weights", "int8"
    )
    assert config.serve == (ServeSpec("a", "0:4", "int8"), ServeSpec("b", "4:8", "int8"))
    assert config.served() == config.serve


def test_two_models_without_layers_serve_every_layer() -> None:
    config = run_config("--model", "a", "--model", "b", "--dtype", "float32")
    assert config.serve == (
        ServeSpec("a", "", "auto", "float32"),
        ServeSpec("b", "", "auto", "float32"),
    )


@pytest.mark.parametrize(
    "args",
    [
        ("--model", "a", "--model", "b", "--layers", "0:4"),
        ("--model", "a", "--model", "b", "--layers", "0:4", "--layers", "4:8", "--layers", "8:9"),
        ("--model", "a", "--layers", "0:4", "--layers", "4:8"),
        ("--layers", "0:4", "--layers", "4:8"),
    ],
)
def test_layers_not_one_per_model_exit_2(args: tuple[str, ...]) -> None:
    assert "swarmd: error: --layers is given" in run_error(*args)


def test_bad_layers_of_several_models_exit_2() -> None:
    output = run_error("--model", "a", "--model", "b", "--layers", "0:4", "--layers", "8")
    assert "swarmd: error: layers must be START:END" in output


def test_same_model_twice_exit_2() -> None:
    assert "'a' is named twice" in run_error("--model", "a", "--model", "a")


def test_no_model_flag_sets_no_model() -> None:
    config = run_config("--no-model")
    assert config.no_model
    assert config.served() == ()


def test_no_model_env_without_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMD_NO_MODEL", "1")
    config = run_config()
    assert config.no_model
    assert config.served() == ()


def test_no_model_with_a_model_exit_2() -> None:
    assert "swarmd: error: no_model" in run_error("--no-model", "--model", "a")
    assert "models to serve" in run_error("--no-model", "--model", "a", "--model", "b")

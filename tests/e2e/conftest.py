"""Fixtures of the end-to-end tier: node processes that several test modules share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import NodeProcess, running_node


@pytest.fixture
def swarm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWARMD_TORCH_THREADS", "1")  # nodes share two cores


@pytest.fixture(scope="module")
def tiny_reference(
    tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    """The tiny random model whole on one node: the reference of the tiny swarms."""
    with running_node(tmp_path_factory, "tiny-ref", ["--model", str(tiny_chat_dir)]) as node:
        yield node

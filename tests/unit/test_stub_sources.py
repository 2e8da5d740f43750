"""The launcher's check that a checkout's gRPC stubs were generated from its proto/ as it is:
a fresh digest passes, an edited, added or renamed .proto or a missing digest is named with the
command that mends it, an installed package (no proto/) is not checked, and the generator and
`make run`'s entry point use it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fairserve.launcher import run_stack
from fairserve.launcher.stack import ROOT, Stack, StackPorts
from fairserve.launcher.stub_sources import DIGEST_FILE, proto_digest, stale_stubs, write_digest
from scripts.gen_protos import generate


def _checkout(root: Path) -> Path:
    """A checkout with one proto and stubs generated from it; returns the proto file."""
    proto = root / "proto" / "fairserve" / "v1" / "a.proto"
    proto.parent.mkdir(parents=True)
    proto.write_text('syntax = "proto3";\npackage fairserve.v1;\nmessage A { int32 x = 1; }\n')
    stubs = root / "fairserve" / "v1"
    stubs.mkdir(parents=True)
    write_digest(stubs, root / "proto")
    return proto


def test_stubs_generated_from_the_sources_as_they_are_pass(tmp_path: Path) -> None:
    _checkout(tmp_path)
    assert stale_stubs(tmp_path) is None


def test_an_edited_proto_makes_the_stubs_stale(tmp_path: Path) -> None:
    proto = _checkout(tmp_path)
    proto.write_text(proto.read_text().replace("}", " double runs_ms = 2; }"))
    reason = stale_stubs(tmp_path)
    assert reason is not None and "older than" in reason and "make proto" in reason


def test_an_added_or_renamed_proto_makes_the_stubs_stale(tmp_path: Path) -> None:
    proto = _checkout(tmp_path)
    proto.rename(proto.with_name("b.proto"))
    assert stale_stubs(tmp_path) is not None
    proto.with_name("b.proto").rename(proto)
    assert stale_stubs(tmp_path) is None
    (proto.parent / "c.proto").write_text('syntax = "proto3";\n')
    assert stale_stubs(tmp_path) is not None


def test_stubs_without_a_digest_are_stale(tmp_path: Path) -> None:
    _checkout(tmp_path)
    (tmp_path / "fairserve" / "v1" / DIGEST_FILE).unlink()
    reason = stale_stubs(tmp_path)
    assert reason is not None and "make proto" in reason


def test_an_installed_package_is_not_checked(tmp_path: Path) -> None:
    (tmp_path / "fairserve" / "v1").mkdir(parents=True)
    assert stale_stubs(tmp_path) is None


def test_the_generator_records_the_sources_it_read(tmp_path: Path) -> None:
    generate(tmp_path)
    recorded = (tmp_path / "fairserve" / "v1" / DIGEST_FILE).read_text().strip()
    assert recorded == proto_digest(ROOT / "proto")


def test_this_checkout_s_stubs_are_current() -> None:
    assert stale_stubs(ROOT) is None


def test_the_stack_and_make_run_refuse_stale_stubs(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr("fairserve.launcher.stack.stale_stubs", lambda root: "stale: run `make proto`")
    with pytest.raises(RuntimeError, match="make proto"):
        Stack(ports=StackPorts.free(1), env={}, log_dir=tmp_path).start(timeout_s=1)
    assert not (tmp_path / "kvcache.log").exists()       # nothing was started
    monkeypatch.setattr(run_stack, "stale_stubs", lambda root: "stale: run `make proto`")
    assert run_stack.main() == 2
    assert "make proto" in capsys.readouterr().err

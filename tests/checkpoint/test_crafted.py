"""Crafted checkpoints, as whoever can write the directory would make them: every manifest
consistent (sizes, sha256 and the manifest's own checksum recomputed), so only ragged's own
checks stand between the files and the process. None runs code, none makes ragged touch a file
outside the checkpoint directory, each is refused on every rank with a CheckpointCorruptError."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil

import pytest
import torch

import ragged as rg
from ragged.checkpoint import CheckpointCorruptError
from ragged.checkpoint import _format as fmt
from tests.checkpoint._util import full_trees, make_state, plan_for

simulate = rg.collectives.simulate


def _saved(tmp_path, m=2):
    path = tmp_path / "ckpt"
    full = full_trees()
    plan = plan_for(full["params"], m)
    simulate(m, lambda comm: rg.checkpoint.save(path, make_state(comm.rank, plan, full), comm))
    return path, plan


def _rewrite_manifest(path, edit=None, *, checksum=True):
    """Re-describes every file of ``path`` (an attacker's consistent manifest), after ``edit``."""
    manifest = json.loads((path / "manifest.json").read_text())
    if edit is not None:
        edit(manifest)
    for name in list(manifest["files"]):
        full = os.path.join(path, name)
        if os.path.isfile(full) and not os.path.islink(full) and os.path.dirname(os.path.abspath(full)) == str(path):
            with open(full, "rb") as f:
                data = f.read()
            import hashlib

            manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if checksum:
        manifest = fmt.with_checksum(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _load_everywhere(path, plan, m=2):
    def fn(comm):
        return rg.checkpoint.load(path, make_state(comm.rank, plan, full_trees(9)), comm)

    return simulate(m, fn)


def _refused(path, plan, pattern):
    with pytest.raises(CheckpointCorruptError, match=pattern):
        _load_everywhere(path, plan)
    with pytest.raises(CheckpointCorruptError, match=pattern):
        rg.checkpoint.consolidate(path)


class _Payload:
    """Unpickles as a call of ``os.system`` (writes the marker file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payload_in_metadata_never_runs(tmp_path):
    path, plan = _saved(tmp_path)
    marker = tmp_path / "marker"
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)  # the real metadata, with a payload riding along (load would succeed)
    md.planner_data = _Payload(marker)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_manifest(path)
    _refused(path, plan, re.escape("asks to load posix.system, which is not part of DCP's metadata"))
    assert not marker.exists()
    # the same file read the way DCP reads it runs the payload: the test has teeth
    torch.distributed.checkpoint.FileSystemReader(str(path)).read_metadata()
    assert marker.exists()


def test_manifest_naming_files_outside_is_refused(tmp_path):
    path, plan = _saved(tmp_path)
    (tmp_path / "outside.bin").write_bytes(b"secret")

    def add(name):
        def edit(manifest):
            manifest["files"][name] = {"size": 6, "sha256": "0" * 64}

        return edit

    for name in ("../outside.bin", str(tmp_path / "outside.bin"), "/etc/hostname", "sub/x", ".."):
        _rewrite_manifest(path, add(name))
        with pytest.raises(CheckpointCorruptError, match=re.escape(f"names the file {name!r}, which is not a plain file name")) as info:
            _load_everywhere(path, plan)
        assert "bytes" not in str(info.value)  # nothing was stat'ed: no size leaks
        _rewrite_manifest(path, lambda manifest, name=name: manifest["files"].pop(name))


def test_metadata_pointing_outside_is_refused(tmp_path):
    path, plan = _saved(tmp_path)
    victim = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[-1]
    shutil.copy(path / victim, tmp_path / "x.distcp")
    md = pickle.loads((path / ".metadata").read_bytes())
    for info in md.storage_data.values():
        if info.relative_path == victim:
            info.relative_path = "../x.distcp"
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_manifest(path)
    os.chmod(tmp_path / "x.distcp", 0)  # were it opened, the read would fail differently
    _refused(path, plan, re.escape("names the file '../x.distcp', which is not a plain file name"))


@pytest.mark.parametrize("which", ["data", ".metadata", "manifest.json"])
def test_symlinks_are_refused(tmp_path, which):
    path, plan = _saved(tmp_path)
    name = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[-1] if which == "data" else which
    shutil.move(path / name, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", path / name)  # same bytes: sizes and checksums still match
    _refused(path, plan, re.escape(f"file {name!r} is a symlink"))


def test_fifo_is_refused_without_blocking(tmp_path):
    path, plan = _saved(tmp_path)
    name = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[-1]
    os.unlink(path / name)
    os.mkfifo(path / name)
    _refused(path, plan, re.escape(f"file {name!r} is not a regular file"))


def test_edited_manifest_scalar_is_refused(tmp_path):
    path, plan = _saved(tmp_path)
    text = (path / "manifest.json").read_text()
    edited = text.replace('"value": 5', '"value": 6')
    assert edited != text
    (path / "manifest.json").write_text(edited)
    _refused(path, plan, "was altered after it was written: its content does not match its own checksum")


def test_metadata_disagreeing_with_manifest_is_refused(tmp_path):
    """A .metadata whose tensor has another dtype than the manifest says (both consistent)."""
    path, plan = _saved(tmp_path)
    md = pickle.loads((path / ".metadata").read_bytes())
    fqn = "['params']['emb']"
    props = md.state_dict_metadata[fqn].properties
    md.state_dict_metadata[fqn].properties = type(props)(dtype=torch.float64)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_manifest(path)
    _refused(path, plan, re.escape(f"DCP metadata stores {fqn!r} as torch.float64; the manifest says float32"))


def test_load_of_a_file_says_it_is_a_file(tmp_path):
    path, plan = _saved(tmp_path)
    out = tmp_path / "model.pt"
    rg.checkpoint.consolidate(path, out)
    with pytest.raises(CheckpointCorruptError, match=re.escape(f"{str(out)!r} is a file, not a checkpoint directory")):
        _load_everywhere(out, plan)
    with pytest.raises(CheckpointCorruptError, match="is a file, not a checkpoint directory"):
        rg.checkpoint.read_manifest(out)


def test_plain_metadata_still_reads_as_dcp(tmp_path):
    """The allow-list covers everything DCP writes for ragged (checked on a real save)."""
    from ragged.checkpoint._metadata import read_metadata

    path, _ = _saved(tmp_path)
    md = read_metadata(str(path))
    ref = pickle.load(io.BytesIO((path / ".metadata").read_bytes()))
    assert md.state_dict_metadata == ref.state_dict_metadata and md.storage_data == ref.storage_data

"""The atomic write (functional_npu/core/files.py) replaces only a regular file this process may write: a FIFO, a
symbolic link, a directory and (run as root, where the replacement once happened) a device node made for the test
are refused in one line and left as they were; a regular file is replaced whole; a failed write leaves the old file
and no temporary file."""

from __future__ import annotations

import os
import stat

import pytest

from functional_npu.core.files import NotARegularFile, check_target, write_bytes


def _entries(tmp_path):
    regular = tmp_path / "regular.json"
    regular.write_bytes(b"old")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.json"
    link.symlink_to(regular)
    folder = tmp_path / "folder"
    folder.mkdir()
    out = {"a FIFO": fifo, "a symbolic link": link, "a directory": folder}
    if os.geteuid() == 0:  # root may make a device node (and, before the check, replaced /dev/null)
        node = tmp_path / "null"
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        out["a character device"] = node
    return regular, out


def test_an_entry_that_is_not_a_regular_file_is_refused_and_left_as_it_was(tmp_path):
    regular, others = _entries(tmp_path)
    for kind, path in others.items():
        before = os.lstat(path).st_mode
        with pytest.raises(NotARegularFile) as e:
            write_bytes(path, b"new")
        assert e.value.strerror == (
            f"{path} is {kind}, not a regular file: writing it whole would replace it with one; give the path of a "
            f"regular file or of a new one"
        )
        assert os.lstat(path).st_mode == before, kind
    assert regular.read_bytes() == b"old"  # the link's target untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["regular.json", *(p.name for p in others.values())])


def test_a_regular_file_or_a_new_one_is_written_whole(tmp_path):
    regular, _ = _entries(tmp_path)
    write_bytes(regular, b"new")
    write_bytes(tmp_path / "fresh.json", b"fresh")
    assert regular.read_bytes() == b"new" and (tmp_path / "fresh.json").read_bytes() == b"fresh"
    check_target(tmp_path / "absent.json")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any file")
def test_a_file_this_process_may_not_write_is_not_replaced(tmp_path):
    locked = tmp_path / "locked.json"
    locked.write_bytes(b"old")
    locked.chmod(0o444)
    with pytest.raises(NotARegularFile, match=r"locked.json is a file this process may not write"):
        write_bytes(locked, b"new")
    assert locked.read_bytes() == b"old"

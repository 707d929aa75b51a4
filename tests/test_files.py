"""deggs/files.py: the atomic write's durability promise, said out loud when it breaks."""

import errno
import logging
import os

from deggs import files


def test_a_directory_fsync_that_fails_is_logged_and_the_file_is_whole(
    tmp_path, monkeypatch, caplog
):
    real_fsync = os.fsync

    def fsync(fd):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    caplog.set_level(logging.WARNING, logger="deggs")
    files.write_atomic(tmp_path / "a.bin", b"whole")
    assert (tmp_path / "a.bin").read_bytes() == b"whole"
    assert "fsync of the directory" in caplog.text and "Input/output error" in caplog.text

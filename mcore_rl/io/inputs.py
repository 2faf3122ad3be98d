"""Reading files of an input folder without being led outside it.

A checkpoint or model folder is untrusted: a symlink inside it (``tokenizer.json -> ~/.ssh/id_rsa``) must
not make a conversion copy any readable file into its output. Every file we open from an input folder goes
through :func:`input_file`, which resolves it and refuses it unless it stays inside the folder.

One exception is made on purpose: a Hugging Face hub cache snapshot
(``.../models--org--name/snapshots/<revision>/``) is made of symlinks into the repository's own
``blobs/`` folder, so for such a folder the repository folder (``models--org--name``) is the boundary.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

from mcore_rl.io.errors import ConfigError, InputError, UnsafeInputError

_HUB_SNAPSHOT = re.compile(r"^(?P<repo>.*/(?:models|datasets)--[^/]+)/snapshots/[^/]+$")


def input_boundary(folder: str) -> str:
    """The real folder that files of ``folder`` must resolve into (see the module docstring)."""
    real = os.path.realpath(folder)
    hub = _HUB_SNAPSHOT.match(real)
    return hub.group("repo") if hub else real


def input_file(folder: str, name: str, required: bool = True) -> str | None:
    """The path of ``folder/name`` once checked: a regular file whose real path stays inside ``folder``.

    Returns None for an absent optional file; raises :class:`InputError` for an absent required one and
    :class:`UnsafeInputError` for a file that resolves outside the folder.
    """
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        if required:
            raise InputError(f"{path}: no such file")
        return None
    boundary = input_boundary(folder)
    real = os.path.realpath(path)
    if not real.startswith(boundary.rstrip(os.sep) + os.sep):
        raise UnsafeInputError(
            f"{path} is a symbolic link to {real}, outside {folder}; refusing to read it "
            "(copy the real file into the folder if it is meant to be there)"
        )
    if not os.path.isfile(real):
        raise InputError(f"{path}: not a regular file")
    return path


def check_input_tree(folder: str, flag: str) -> None:
    """Every entry of ``folder`` (recursively) resolves inside it; a folder we hand to a library that
    opens files by itself (megatron's checkpoint loader) is checked this way first."""
    if not os.path.isdir(folder):
        raise InputError(f"{flag} {folder} is not a folder")
    boundary = input_boundary(folder)
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                real = os.path.realpath(path)
                if not real.startswith(boundary.rstrip(os.sep) + os.sep):
                    raise UnsafeInputError(
                        f"{path} is a symbolic link to {real}, outside {folder}; refusing to read the checkpoint"
                    )


def copy_input_file(folder: str, name: str, destination: str) -> bool:
    """Copy ``folder/name`` (checked by :func:`input_file`) as a regular file; False when absent."""
    source = input_file(folder, name, required=False)
    if source is None:
        return False
    os.makedirs(destination, exist_ok=True)
    shutil.copyfile(os.path.realpath(source), os.path.join(destination, name), follow_symlinks=False)
    return True


def read_json_object(path: str, error: type[InputError] = ConfigError) -> dict[str, Any]:
    """A JSON object from ``path``; anything else (missing, unreadable, not JSON, not an object) raises one
    ``error`` naming the file."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as err:
        raise error(f"{path}: cannot read ({err.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object, found {type(raw).__name__}")
    return raw

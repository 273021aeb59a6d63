"""``"module:attribute"`` references: how a config names a component from the user's own code.

An algorithm (``algo.name``), an encoder (``model.encoder``) or an env (``env.id``) may be
given as ``"package.module:attribute"``. Every process that needs the component imports the
module itself (it is not pickled or sent). A module found in the directory ``rlpipe launch``
ran in is imported from there in every service of the run: the launcher names it in the
services' ``IMPORT_DIR`` variable (``rundirs.service_env``: only where a reference needs it, and
only a directory no other user can write to), and it goes at the end of ``sys.path``, after
site-packages, so that nothing else there shadows an installed package.
"""

from __future__ import annotations

import importlib
import os
import sys

IMPORT_DIR = "RLPIPE_IMPORT_DIR"
"""The environment variable naming the launch directory, where the config's references need it."""


def is_reference(name: str) -> bool:
    """Whether ``name`` has the ``module:attribute`` form (built-in names have no colon)."""
    return ":" in name


def first_line(e: BaseException) -> str:
    """An exception as one line: its message's first line, or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_attribute(ref: str, field: str):
    """The object ``ref`` (``"module:attribute"``, the attribute may be dotted) names.

    ValueError, one line naming ``field`` (e.g. ``algo.name``) and what failed: a malformed
    reference, a module that cannot be imported (with the import's own first line), or a
    missing attribute.
    """
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{field} = {ref!r}: a reference is 'module:attribute', e.g. 'mylab.nets:ResNetEncoder'")
    where = os.environ.get(IMPORT_DIR)
    if where and where not in sys.path:
        sys.path.append(where)  # last: site-packages first
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - whatever the user's module raises, it is this field's error
        raise ValueError(f"{field} = {ref!r}: cannot import module {module_name!r} ({first_line(e)})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{field} = {ref!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj

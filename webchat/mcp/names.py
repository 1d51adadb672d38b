"""Names the model sees: a server's name checked once, each tool's qualified `server__tool` made safe and unique.

A qualified name matches `^[a-zA-Z0-9_-]{1,64}$` (what OpenAI's API and the chat templates accept). A server name
never holds `__` and never starts or ends with `_`, so the first `__` of a qualified name always ends its server's
part: two servers cannot produce the same qualified name, and a server's names depend on its own listing only.
"""

from __future__ import annotations

import re

MAX_QUALIFIED = 64
MAX_SERVER_NAME = 32
SEPARATOR = "__"
SERVER_NAME = re.compile(r"[A-Za-z0-9-](?:[A-Za-z0-9-]|_(?!_))*(?<!_)")
UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def server_name_problem(name: str) -> str | None:
    """Why `name` cannot name a server (None when it can): the rule, stated for the user."""
    if len(name) <= MAX_SERVER_NAME and SERVER_NAME.fullmatch(name):
        return None
    return (f"expected 1-{MAX_SERVER_NAME} letters, digits and '-', with single '_' inside (such as 'web-search' "
            f"or 'my_files'), got {name!r}")


def split_qualified(qualified: str) -> tuple[str, str]:
    """The server part and the tool part of a qualified name (the tool part is '' when there is no separator)."""
    server, _, tool = qualified.partition(SEPARATOR)
    return server, tool


def qualify(server: str, tool: str, taken: set[str]) -> str:
    """`server__tool` with unsafe characters as `_`, cut to 64 characters, and `_2`, `_3`, ... until not in `taken`;
    the result is added to `taken`."""
    room = MAX_QUALIFIED - len(server) - len(SEPARATOR)
    part = UNSAFE.sub("_", tool)[:room] or "_"
    candidate, n = part, 1
    while f"{server}{SEPARATOR}{candidate}" in taken:
        n += 1
        suffix = f"_{n}"
        candidate = part[: room - len(suffix)] + suffix
    qualified = f"{server}{SEPARATOR}{candidate}"
    taken.add(qualified)
    return qualified

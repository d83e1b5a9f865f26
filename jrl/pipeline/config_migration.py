"""Config keys that moved: a saved config.json or a --set override written before a move is read
under the new key, with one line saying so (runs made before the change still resume).

MOVED_KEYS maps an old dotted key to its new one. A key whose name became a section (for example
rollout.speculative, once the number of drafts, now the section holding it) moves only when its
value is not already a section.
"""

from __future__ import annotations

MOVED_KEYS = {
    "rollout.speculative": "rollout.speculative.num_draft",
    "rollout.speculative_ngram": "rollout.speculative.ngram_max",
    "rollout.speculative_draft": "rollout.speculative.draft",
    "rollout.speculative_min_accept": "rollout.speculative.draft_min_accept",
    "rollout.speculative_draft_pick": "rollout.speculative.draft_pick",
}


def _note(old: str, new: str) -> str:
    return f"config key {old} is now {new}: read as {new}"


def migrate_dict(data: dict) -> list[str]:
    """Moves every old key of a nested config dict (a config.json) to its new place, in place;
    returns one note per key moved. An old key and its new one both given is refused
    (ValueError naming both): one of the two values would be lost."""
    notes = []
    for old, new in MOVED_KEYS.items():
        *old_path, old_name = old.split(".")
        parent = _section(data, old_path)
        if parent is None or old_name not in parent or isinstance(parent[old_name], dict):
            continue
        value = parent.pop(old_name)
        *new_path, new_name = new.split(".")
        target = data
        for name in new_path:
            target = target.setdefault(name, {})
            if not isinstance(target, dict):
                raise ValueError(f"config key {old} moved to {new}, but {name} holds "
                                 f"{target!r}, not a section")
        if new_name in target:
            raise ValueError(f"config keys {old} and {new} are both given; {old} is the old "
                             f"name of {new}: keep one")
        target[new_name] = value
        notes.append(_note(old, new))
    return notes


def migrate_override(item: str) -> tuple[str, str | None]:
    """A --set "key=value" with an old key rewritten to the new one, and the note (None where
    the key did not move)."""
    key, sep, value = item.partition("=")
    new = MOVED_KEYS.get(key.strip())
    if not sep or new is None:
        return item, None
    return f"{new}={value}", _note(key.strip(), new)


def _section(data: dict, path: list[str]) -> dict | None:
    for name in path:
        data = data.get(name) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None

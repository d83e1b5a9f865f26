"""Config keys that moved: a saved config.json or a --set override written before a move is read
under the new key, with one line saying so (runs made before the change still resume).

MOVED_KEYS maps an old dotted key to its new one. A key whose name became a section (for example
rollout.speculative, once the number of drafts, now the section holding it) moves only when its
value is not already a section.

The loss section became algorithm (loss.preset is algorithm.recipe) and took rollout's reward
shaping keys. One value changed meaning with it: loss.eps_low / eps_high under preset grpo or
dr_grpo, where one bound set alone clipped both sides (those presets took one eps); the
algorithm section's bounds mean the same for every recipe (the ratio clipped to
[1 - eps_low, 1 + eps_high]), so such a config.json is read with both bounds set to that value.

The top-level tensorboard ("auto", "true", "false") and wandb ("false", "online", "offline") keys
became the metrics section's one list of backends (metrics.backends, metrics.wandb_mode): both at
their defaults read as backends unset; otherwise as the list of what they turned on, jsonl
first. tensorboard="auto" beside a W&B run has no list form (it probed for tensorboardX): it is
read as TensorBoard left out, and the note says so.
"""

from __future__ import annotations

MOVED_KEYS = {
    "rollout.speculative": "rollout.speculative.num_draft",
    "rollout.speculative_ngram": "rollout.speculative.ngram_max",
    "rollout.speculative_draft": "rollout.speculative.draft",
    "rollout.speculative_min_accept": "rollout.speculative.draft_min_accept",
    "rollout.speculative_draft_pick": "rollout.speculative.draft_pick",
    "loss.preset": "algorithm.recipe",
    **{f"loss.{name}": f"algorithm.{name}" for name in (
        "factory", "eps_low", "eps_high", "std_power", "unbiased_std", "kl_beta", "kl_kind",
        "kl_straight_through", "kl_importance_weighted", "entropy_coef", "tis_cap",
        "tis_level", "mis_threshold", "mis_level", "load_balance_coef")},
    "rollout.dynamic_sampling": "algorithm.dynamic_sampling",
    "rollout.overlong_buffer": "algorithm.overlong_buffer",
    "rollout.overlong_factor": "algorithm.overlong_factor",
}

# Old presets that took one symmetric eps: a bound given alone there clipped both sides.
_SYMMETRIC_PRESETS = ("grpo", "dr_grpo")
_EPS_NOTE = (" (algorithm.eps_low / eps_high bound [1 - eps_low, 1 + eps_high] for every "
             "recipe: for a symmetric clip set both)")


# The old top-level metrics keys: their allowed values, the first one the default.
OLD_METRICS_KEYS = {"tensorboard": ("auto", "true", "false"),
                    "wandb": ("false", "online", "offline")}


def _note(old: str, new: str) -> str:
    return f"config key {old} is now {new}: read as {new}"


def migrate_dict(data: dict) -> list[str]:
    """Moves every old key of a nested config dict (a config.json) to its new place, in place;
    returns one note per key moved. An old key and its new one both given is refused
    (ValueError naming both): one of the two values would be lost."""
    notes = _symmetric_clip(data) + _metrics_backends(data)
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
        if not parent and len(old_path) == 1:
            del data[old_path[0]]        # a section whose keys all moved (loss) is gone
    return notes


def migrate_override(item: str) -> tuple[str, str | None]:
    """A --set "key=value" with an old key rewritten to the new one, and the note (None where
    the key did not move)."""
    key, sep, value = item.partition("=")
    new = MOVED_KEYS.get(key.strip())
    if not sep or new is None:
        return item, None
    note = _note(key.strip(), new)
    if key.strip() in ("loss.eps_low", "loss.eps_high"):
        note += _EPS_NOTE
    return f"{new}={value}", note


def migrate_overrides(items: list[str]) -> tuple[list[str], list[str]]:
    """--set items with old keys rewritten (migrate_override), the old tensorboard= / wandb=
    items turned into metrics.* items together; and one note per old key."""
    out, notes, old_metrics = [], [], {}
    for item in items:
        key, sep, value = item.partition("=")
        if sep and key.strip() in OLD_METRICS_KEYS:
            old_metrics[key.strip()] = value.strip()
            continue
        item, note = migrate_override(item)
        out.append(item)
        notes += [note] if note else []
    if old_metrics:
        section, metric_notes = _metrics_section(old_metrics)
        notes += metric_notes
        backends = section.get("backends")
        out.append("metrics.backends=" + ("null" if backends is None
                                          else "[" + ",".join(backends) + "]"))
        if "wandb_mode" in section:
            out.append(f"metrics.wandb_mode={section['wandb_mode']}")
    return out, notes


def _metrics_backends(data: dict) -> list[str]:
    """A config.json's old top-level tensorboard / wandb keys moved into its metrics section."""
    old = {key: data.pop(key) for key in OLD_METRICS_KEYS if key in data}
    if not old:
        return []
    if isinstance(data.get("metrics"), dict) and data["metrics"]:
        raise ValueError(f"config keys {', '.join(sorted(old))} and metrics are both given; "
                         f"{' and '.join(sorted(old))} are the old form of metrics.backends: "
                         "keep the metrics section")
    section, notes = _metrics_section(old)
    data["metrics"] = section
    return notes


def _metrics_section(old: dict) -> tuple[dict, list[str]]:
    """The metrics section of old tensorboard / wandb values (strings, or JSON booleans for
    tensorboard), and one note per old key."""
    values = {}
    for key, allowed in OLD_METRICS_KEYS.items():
        value = old.get(key, allowed[0])
        value = str(value).lower() if isinstance(value, bool) else value
        if value not in allowed:
            raise ValueError(f"config key {key}={value!r} (now metrics.backends): allowed "
                             f"values are {list(allowed)}")
        values[key] = value
    tensorboard, wandb = values["tensorboard"], values["wandb"]
    section: dict = {}
    if tensorboard != "auto" or wandb != "false":
        section["backends"] = (["jsonl"] + ["tensorboard"] * (tensorboard == "true")
                               + ["wandb"] * (wandb != "false"))
    if wandb != "false":
        section["wandb_mode"] = wandb
    read_as = f"metrics.backends={section.get('backends')}".replace("None", "unset")
    if wandb != "false":
        read_as += f", metrics.wandb_mode={wandb!r}"
    notes = []
    for key in old:
        note = f"config key {key}={values[key]!r} is now metrics.backends: read as {read_as}"
        if key == "tensorboard" and tensorboard == "auto" and wandb != "false":
            note += (" (TensorBoard where installed has no list form: add tensorboard to "
                     "metrics.backends to keep it)")
        notes.append(note)
    return section, notes


def _symmetric_clip(data: dict) -> list[str]:
    """An old loss section of preset grpo / dr_grpo (grpo: the default) with one clip bound
    set: the other set to it, as the preset's one eps clipped both sides."""
    loss = _section(data, ["loss"])
    if loss is None or loss.get("preset", "grpo") not in _SYMMETRIC_PRESETS:
        return []
    given = [name for name in ("eps_low", "eps_high") if loss.get(name) is not None]
    if len(given) != 1:
        return []
    (name,), other = given, ({"eps_low", "eps_high"} - set(given)).pop()
    loss[other] = loss[name]
    return [f"config key loss.{name}={loss[name]!r} of preset {loss.get('preset', 'grpo')!r} "
            f"clipped both sides: read as algorithm.eps_low = algorithm.eps_high = "
            f"{loss[name]!r}"]


def _section(data: dict, path: list[str]) -> dict | None:
    for name in path:
        data = data.get(name) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else None

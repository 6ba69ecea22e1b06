"""Text the workload writes and the agent reads, outside the binary layout (llmobs.shm.layout).

Both sides spell these the same way, so they live here and neither side imports the other for them:
- a layer-stream module's qualified name, registered in the names ring as a NAME_OTHER record
  `module:<kind>:<layer>:<qualified name>` (the store's `layer_modules` table is folded from them);
- the dL/dE dump a training workload writes next to its map on CMD_DUMP_GRADIENTS;
- the replay result the flight recorder writes next to its map on CMD_REPLAY.
"""

from __future__ import annotations

MODULE_NAME_PREFIX = "module:"  # names-ring text of a layer-stream module: module:<kind>:<layer>:<name>
DUMP_SUFFIX = ".dLdE."  # <map path>.dLdE.<ack_step_seq>.npz
REPLAY_SUFFIX = ".replay."  # <map path>.replay.<ack_step_seq>.npz


def module_name(kind: int, layer: int, qualified_name: str) -> str:
    """The names-ring text that registers the module a layer stream of `kind` measures at `layer`."""
    return f"{MODULE_NAME_PREFIX}{kind}:{layer}:{qualified_name}"


def parse_module_name(text: str) -> tuple[int, int, str] | None:
    """(kind, layer, qualified name) of a `module:` name record; None for any other name."""
    if not text.startswith(MODULE_NAME_PREFIX):
        return None
    parts = text[len(MODULE_NAME_PREFIX) :].split(":", 2)
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or not parts[2]:
        return None
    return int(parts[0]), int(parts[1]), parts[2]


def dump_path(map_path: str, ack_step_seq: int) -> str:
    """The .npz a training workload dumps dL/dE into for the command acknowledged at `ack_step_seq`."""
    return f"{map_path}{DUMP_SUFFIX}{ack_step_seq}.npz"


def replay_path(map_path: str, ack_step_seq: int) -> str:
    """The .npz the flight recorder writes a replay into for the command acknowledged at `ack_step_seq`."""
    return f"{map_path}{REPLAY_SUFFIX}{ack_step_seq}.npz"

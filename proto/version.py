"""Protocol version and the compatibility rule.

Every frame carries ``(major, minor)`` in its header. Peers interoperate when the majors
are equal; a minor bump only adds optional fields that an older peer ignores (decoders
reject unknown fields of the *same* minor and accept them from a newer minor).
"""

from __future__ import annotations

from proto.errors import ProtocolError

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 12  # 1.1: WorkItem.stop; 1.2: WeightAnnounce.collective; 1.3: digest_kind;
# 1.4: WorkItem.eval_depth; 1.5: Rollout.full_depth; 1.6: Rollout.token_mask;
# 1.7: Rollout.exit_logprobs; 1.8: Welcome.exit_policy; 1.9: WeightAnnounce.cuda_ipc;
# 1.10: WeightAnnounce.adapter; 1.11: digest_kind mix128 (a version on the device only);
# 1.12: an adapter version on the device (cuda_ipc.holds adapter, the base's buffer)
PROTOCOL_VERSION: tuple[int, int] = (PROTOCOL_MAJOR, PROTOCOL_MINOR)


def check_compatible(remote: tuple[int, int], *, what: str = "peer") -> None:
    """Raise ProtocolError unless a peer speaking ``remote`` can talk to this build."""
    major, minor = remote
    if major != PROTOCOL_MAJOR:
        raise ProtocolError(
            f"incompatible protocol version {major}.{minor} from {what}: this build speaks "
            f"{PROTOCOL_MAJOR}.x (major versions must match; upgrade the older side)"
        )


def is_newer_minor(remote: tuple[int, int]) -> bool:
    """True when the remote speaks a newer minor of our major (unknown fields allowed)."""
    return remote[0] == PROTOCOL_MAJOR and remote[1] > PROTOCOL_MINOR

"""The parts of `runtime.lane_group.LaneGroupExecutor`: its lane transports (in-process,
one process each) and their shared protocol, the fan-out of one call over the lanes, the
barrier rules between lanes, and the group's read-only view of its lanes' facts."""

from runtime.lanes.inprocess import InProcessLane
from runtime.lanes.process import ProcessLane, RemoteKVCache, RemoteRef, spawn_process_lanes
from runtime.lanes.protocol import Lane, LaneCall, LaneFacts, LaneFailure, RemoteLaneError

__all__ = [
    "InProcessLane",
    "Lane",
    "LaneCall",
    "LaneFacts",
    "LaneFailure",
    "ProcessLane",
    "RemoteKVCache",
    "RemoteLaneError",
    "RemoteRef",
    "spawn_process_lanes",
]

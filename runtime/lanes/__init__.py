"""Lane transports for `runtime.lane_group.LaneGroupExecutor`: in-process and one process each."""

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

"""Generation on top of a SERVING executor: block tables, the scheduler and the `Generator`."""

from models.generation.block_manager import BlockManager, BlockTable, NoFreeBlocksError
from models.generation.generator import (
    ByteTokenizer,
    Completion,
    GenerationParams,
    GenerationStats,
    GenerationStream,
    Generator,
    StreamEvent,
)
from models.generation.scheduler import Admission, FinishReason, Scheduler, SequenceState

__all__ = [
    "Admission",
    "BlockManager",
    "BlockTable",
    "ByteTokenizer",
    "Completion",
    "FinishReason",
    "GenerationParams",
    "GenerationStats",
    "GenerationStream",
    "Generator",
    "NoFreeBlocksError",
    "Scheduler",
    "SequenceState",
    "StreamEvent",
]

"""Generation on top of a SERVING executor: block tables, the scheduler and the `Generator`.

`params` (a request's sampling and stopping values), `tokenizers`, `text` (incremental
detokenization with stop strings), `generator` (request validation, the public calls),
`stream` (the step loop), `results` (what a call hands back), `scheduler` and `block_manager`.
"""

from models.generation.block_manager import BlockManager, BlockTable, NoFreeBlocksError
from models.generation.drain import DrainResult, HandedBack
from models.generation.generator import Generator
from models.generation.params import GenerationParams
from models.generation.results import Completion, GenerationStats, StreamEvent
from models.generation.scheduler import Admission, FinishReason, Scheduler, SequenceState
from models.generation.stream import GenerationStream
from models.generation.tokenizers import ByteTokenizer

__all__ = [
    "Admission",
    "BlockManager",
    "BlockTable",
    "ByteTokenizer",
    "Completion",
    "DrainResult",
    "FinishReason",
    "GenerationParams",
    "GenerationStats",
    "GenerationStream",
    "Generator",
    "HandedBack",
    "NoFreeBlocksError",
    "Scheduler",
    "SequenceState",
    "StreamEvent",
]

"""Lossless activation codec: byte-split + zstd, framed, versioned and checksummed.

```python
from bloombee import codec

data = codec.encode(hidden)                         # "auto": smallest layout worth it, tiny -> raw
data = codec.encode(hidden, accepted=peer_layouts)  # only layouts the peer decodes (else raw)
hidden = codec.decode(data)                         # CPU tensor, bit-identical; CodecError if bad
codec.CODEC_VERSION, codec.LAYOUTS                  # what a server announces it accepts
policy = codec.CompressionPolicy("auto", link_bandwidth=2.5e6)  # one per link, bytes/s
layout = policy.choose(num_bytes)                   # "raw" or "auto" by the break-even rule
```
"""

from .calls import CallCosts, call_costs
from .core import DEFAULT_LEVEL, DEFAULT_MAX_BYTES, FrameInfo, auto_candidates, decode, encode, inspect
from .entropy import byte_entropy
from .frame import CODEC_VERSION, LAYOUTS, CodecError, frame_layout
from .policy import CompressionPolicy
from .threads import run_codec

__all__ = [
    "CODEC_VERSION",
    "LAYOUTS",
    "DEFAULT_LEVEL",
    "DEFAULT_MAX_BYTES",
    "CallCosts",
    "CodecError",
    "CompressionPolicy",
    "FrameInfo",
    "auto_candidates",
    "byte_entropy",
    "call_costs",
    "decode",
    "encode",
    "frame_layout",
    "inspect",
    "run_codec",
]

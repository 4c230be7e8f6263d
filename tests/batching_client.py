"""One client process of tests/test_swarm_batching.py: a session stepping a prompt and greedy tokens through the
swarm; prints its tokens and the bytes of its last hidden states as JSON (or sleeps mid-generation when told to, to be
killed there)."""

import hashlib
import json
import sys
import time

import torch

from bloombee.client import AutoDistributedModel

if __name__ == "__main__":
    model_name, seed, new_tokens, pause_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    peers = sys.argv[5:]
    prompt = torch.randint(3, 4000, (1, 16), generator=torch.Generator().manual_seed(seed))
    with AutoDistributedModel.from_pretrained(model_name, initial_peers=peers) as model, torch.inference_mode():
        with model.remote.inference_session(max_length=16 + new_tokens) as session:
            hidden = session.step(model.head.embed(prompt))
            tokens = [int(model.head.logits(hidden)[0, -1].argmax())]
            for index in range(new_tokens - 1):
                if index == pause_at:
                    print("paused", flush=True)
                    time.sleep(600)
                hidden = session.step(model.head.embed(torch.tensor([[tokens[-1]]])))
                tokens.append(int(model.head.logits(hidden)[0, -1].argmax()))
    print(json.dumps({"tokens": tokens, "hidden": hashlib.sha256(hidden.float().numpy().tobytes()).hexdigest()}))

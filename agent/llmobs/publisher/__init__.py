"""The workload side: what `import llmobs` puts inside the PyTorch program (llmobs/__init__.py maps the
public names here lazily, so `import llmobs` alone loads neither torch nor numpy).

request.py      llmobs.request / llmobs.context: one request's token steps into the shared-memory map
labels.py       a request's variant and labels: validated, bounded, counted drops
factors.py      model factors read off the model (adapters, dtype, quant, tokenizer, vocab)
intent.py       the prompt intent fingerprint (opt-in; ids and hashes, never the text)
hf.py           llmobs.instrument: the Hugging Face integration (generate() and forward(labels=...) hooks)
serving.py      continuous batching, engine-neutral: mixed passes of many requests, request-end records
hf_serving.py   its transformers adapter (ContinuousBatchingManager; llmobs.serving.instrument_manager)
device_math.py  the per-token metrics computed on the model's device (loss, entropy, p(target), rank)
shared_loss.py  a labelled pass's loss from the metrics' own log-softmax (no second one in the model)
training.py     training mode: the dL/dE device ring and its dump on the agent's command
recorder.py     the flight recorder: token ids + chunked KV snapshots, CMD_REPLAY on a background thread
replay_thread.py  which threads run a replay (the live hooks skip them)
shadow.py       llmobs.shadow: a second model scores each request teacher-forced on its own thread
replay.py       the replay engine: replay_window over a model, the result file's arrays (ReplayResult)
replay_capture.py  its capture, on the replay's thread only (hooks, attention wrapper, op recorder)
layer_base.py   the shared base of the layer streams; attention.py and layers.py build on it
attention.py    per-layer attention entropy
layers.py       MLP output variance and llmobs.LayerStreams (every layer stream under one policy)

This package imports only llmobs.shm and llmobs.cupti (and the bottom layer), never the agent side
(the import contract in pyproject.toml holds it to that).
"""

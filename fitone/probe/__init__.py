"""`fitone probe-batch`: the largest micro-batch that trains, found by trials on a real engine.

search.py: the search, given a try(size) function; results.py: what it measured (data);
trial.py: the model and engine a trial runs on; cache.py: the saved results; api.py: `probe_batch`
and training's `--batch-size auto`. Empty of imports, so `fitone.probe.search` loads without torch.
"""

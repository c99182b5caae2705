"""Training input: from committed hidden-states shards to a step's model inputs on the device.

One module a step of a hidden state's way into training:
- rows: which rows a rank reads, in which order, resumably; each decoded by eagle3.extract.codec as
  views of the shard's memory
- online: the same rows from hidden-states tables the engines hand over through the Ray object
  store while training runs (`train.source: online`), in the same order
- packing: rows packed into micro-batches of speculators' CollateFn format (compat/
  speculators_batch.py checks the format against speculators)
- ring: the shared memory that worker processes pack batches into
- prefetch: batches built ahead, in a thread or in DataLoader worker processes
- staging: a batch's model inputs copied (fp8 dequantised) to the device under the step before
- pipeline: which of these a rank runs, and how deep, from the train config and the machine
- vocab: token frequencies of the data and the draft vocabulary's d2t / t2d mapping
"""

"""transformers' Trainer with ``--deepspeed``, as data: what it reads and what it hands DeepSpeed.

Pure Python (no transformers, torch or deepspeed import); the versions modelled are transformers 5.17.0,
accelerate 1.15.0 and deepspeed 0.19.8.

- ``args``: ``TrainingArgs``, the TrainingArguments fields that change memory or the DeepSpeed config, with
  transformers 5.17's defaults, and the reader of ``TrainingArguments.to_json_string()`` files
  (``--training-args``); ``fields.json`` lists every TrainingArguments field (``gen_fields.py`` writes it).
- ``flags``: the Trainer flags of a launch line, as HfArgumentParser reads them, and which flags were not used.
- ``autofill``: a DeepSpeed JSON's "auto" filled exactly as TrainingArguments / the Trainer / Accelerate fill
  it, with the mismatches and launch errors they raise.
- ``job``: the job fields the Trainer decides (loop, checkpointing kwargs, optimizer) and what stops it.

Vocabulary: *the arguments* are a TrainingArguments; *the template* is the DeepSpeed JSON as given; *the
filled config* is what deepspeed.initialize receives from the Trainer; *world* is TrainingArguments.world_size,
every process.
"""

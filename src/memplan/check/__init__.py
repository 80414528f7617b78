"""`memplan check`: validate a DeepSpeed config and launch line before launch, then give the memory verdict.

- findings.py: the Finding type (severity, subject, message, fix).
- tables.py / tables.json: DeepSpeed's config keys, launcher flags and Megatron-DeepSpeed's flags, generated
  from their sources by gen_tables.py (a test regenerates the DeepSpeed part and compares).
- launch.py: parsing a deepspeed / torchrun / accelerate launch line.
- rules_ds.py: rules on the DeepSpeed JSON alone; rules_job.py: rules across config, launch line and model.
- command.py: the command (add_arguments, run).

Every rule cites the DeepSpeed 0.19.8 or Megatron-DeepSpeed code it models.
"""

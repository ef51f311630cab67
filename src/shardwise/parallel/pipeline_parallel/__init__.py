"""Pipeline parallelism: stages split by module paths, run by torch.distributed.pipelining's schedules.

``pipeline`` (split_stage, PipelineRunner) and ``split`` (pure: the stages of each rank, the
modules of each stage).
"""

"""Other tools' checkpoints: DeepSpeed's ZeRO directories and the torch.save files they are
made of (read without executing them), torch.distributed.checkpoint (DCP) directories as
FSDP2 and torchtitan save them, read and written."""

"""Loops and tools written for plain PyTorch: the drop-in optimizer and clip_grad_norm_,
torch.compile, the step clock."""

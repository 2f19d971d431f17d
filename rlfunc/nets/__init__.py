"""Plain nn.Modules used only as skeletons for torch.func.functional_call."""

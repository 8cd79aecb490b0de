"""Where kernels go in a model: the torch.library glue that makes each kernel a custom op with
autograd and fake registrations (torch_op.py), and the one way a patch is installed on a module
(install.py). The per-operator patches still live beside their OpSpecs in aurakernel/ops/."""

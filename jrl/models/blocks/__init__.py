"""One module per block type of the decoder: token mixers (softmax attention, Gated DeltaNet) and
MLPs (dense SwiGLU, mixture of experts). Each states its params' shapes, its cache's shapes (for
mixers) and its forward through jrl.kernels; jrl.models.transformer stacks them into layers."""

// Precompiled header: the libtorch headers nearly every translation unit needs. Kept to ATen
// and autograd (not <torch/torch.h>) because each extra header costs seconds per file.
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

// The C callbacks of caller-defined layers and device losses, as the engine's callables: tensors
// cross as DLPack, statuses become rp::Error(Callback) naming what failed.
#pragma once
#include "api/handles.h"
#include "layers/caller_layer.h"

namespace rp {

// The engine layer for a declaration; copies everything it needs from `def`.
std::unique_ptr<Layer> make_caller_layer(const rp_layer_def &def);

DeviceLossCallback make_device_loss_callback(rp_device_loss_fn fn, void *user_data);

} // namespace rp

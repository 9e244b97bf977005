// The checks around one kernel launch (header-only, no CANN or torch dependency): the launch
// happens on the device that holds the tensors (device guard, restored afterwards), on a
// non-null stream, and a non-zero return code of the generated aclrtlaunch_* function is an
// error, never ignored. The NPU binding instantiates GuardedLaunch with the torch_npu
// runtime; the CPU-model tests instantiate it with a fake runtime (cpu_model/src/binding.cpp,
// launch_selftest) to check the order of those steps and the messages.
#ifndef TOPTH_LAUNCH_H
#define TOPTH_LAUNCH_H

#include <cstdint>
#include <stdexcept>
#include <string>

namespace topth {

class LaunchError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// Runtime: int CurrentDevice(); void SetDevice(int); void RestoreDevice(int);
//          void* CurrentStream(int device); Launch: uint32_t(void* stream).
// Steps: switch to the tensors' device (if it is not current), take that device's current
// stream, refuse a null stream, launch, restore the previous device (also on errors),
// refuse a non-zero return code.
template <class Runtime, class Launch>
inline void GuardedLaunch(Runtime& rt, int tensorDevice, const char* kernel, Launch&& launch) {
    const int previous = rt.CurrentDevice();
    const bool switched = previous != tensorDevice;
    if (switched) rt.SetDevice(tensorDevice);
    struct Restore {
        Runtime& rt;
        int previous;
        bool active;
        ~Restore() {
            if (active) rt.RestoreDevice(previous);
        }
    } restore{rt, previous, switched};
    if (rt.CurrentDevice() != tensorDevice) {
        throw LaunchError(std::string("topth ascendc: could not make device ") + std::to_string(tensorDevice) +
                          " (the tensors' device) current for " + kernel + "; current device is " +
                          std::to_string(rt.CurrentDevice()));
    }
    void* stream = rt.CurrentStream(tensorDevice);
    if (stream == nullptr) {
        throw LaunchError(std::string("topth ascendc: the current stream of device ") + std::to_string(tensorDevice) +
                          " is null; " + kernel + " was not launched");
    }
    const uint32_t rc = launch(stream);
    if (rc != 0) {
        throw LaunchError(std::string("topth ascendc: launching ") + kernel + " on device " +
                          std::to_string(tensorDevice) + " failed with error code " + std::to_string(rc) +
                          " (an aclError; see the CANN log, ASCEND_GLOBAL_LOG_LEVEL=1)");
    }
}

}  // namespace topth

#endif  // TOPTH_LAUNCH_H

"""Why profile_step --by-source names no eagle3 function on the GPU image: which profiler settings give
Python frames to operators whose kernels ran on CUDA (run on the device, prints one line per setting)."""
import torch


def inner(x):
    return (x @ x).relu()


def outer(x):
    return inner(x) + 1


x = torch.randn(256, 256, device="cuda")
outer(x)
torch.cuda.synchronize()
cfgs = {"with_stack": {}}
if hasattr(torch._C._profiler, "_ExperimentalConfig"):
    cfgs["with_stack+verbose"] = {"experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)}
for name, extra in cfgs.items():
    for acts in ([torch.profiler.ProfilerActivity.CPU],
                 [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]):
        with torch.profiler.profile(activities=acts, with_stack=True, **extra) as prof:
            outer(x)
            torch.cuda.synchronize()
        mm = [e for e in prof.events() if e.name == "aten::mm"]
        parents, e = [], mm[0].cpu_parent if mm else None
        while e is not None:
            parents.append(e.name)
            e = e.cpu_parent
        print(f"{name:20s} {len(acts)} activities: mm events {len(mm)}, stack {mm[0].stack[:3] if mm else None}, "
              f"parents {parents[:4]}, torch {torch.__version__}")

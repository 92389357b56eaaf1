"""Step-time simulator: the real scheduler and KV cache managers on a simulated clock, with
the model replaced by a roofline cost model per device (devices.py) and model shape
(shapes.py, from the configs in models/presets.py)."""
from pagedserve.sim.cost import CostModel, StepTime, StepWork
from pagedserve.sim.devices import DEVICES, EFFICIENCY_SOURCES, Device, Efficiency, get_device
from pagedserve.sim.driver import SimConfig, SimRequest, SimResult, Simulation, simulate, sustained_rate
from pagedserve.sim.shapes import ModelShape

__all__ = ["CostModel", "StepTime", "StepWork", "DEVICES", "EFFICIENCY_SOURCES", "Device", "Efficiency", "get_device",
           "SimConfig", "SimRequest", "SimResult", "Simulation", "simulate", "sustained_rate", "ModelShape"]

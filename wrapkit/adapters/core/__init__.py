"""What every adapter is built on: the base class and its kinds, the parts of the whole-tensor storage kind
(the default), the primitives operations call, topology, recipes, the checks of ``adapt()``, likeness for
references, and the register of other libraries' private fields wrapkit reads."""

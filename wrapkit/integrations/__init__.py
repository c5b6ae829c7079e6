"""Drop-ins for the helpers of trainer libraries, built on wrapkit. Each submodule imports its
library only when called."""

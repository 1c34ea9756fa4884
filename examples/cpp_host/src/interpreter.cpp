#include <pybind11/embed.h>

#include <memory>

#include "python_executor.h"

namespace py = pybind11;

namespace cpp_host {

namespace {
std::unique_ptr<py::scoped_interpreter> g_interpreter;
}

Interpreter::Interpreter(const std::string& python) {
  if (g_interpreter) throw std::logic_error("the interpreter is started once per process");
  PyConfig config;
  PyConfig_InitPythonConfig(&config);
  // the interpreter finds its prefix, and a venv's pyvenv.cfg, from the executable's path
  PyStatus status = PyConfig_SetBytesString(&config, &config.program_name, python.c_str());
  if (PyStatus_Exception(status)) {
    PyConfig_Clear(&config);
    throw std::runtime_error("cannot set the Python program name to " + python);
  }
  config.parse_argv = 0;
  config.install_signal_handlers = 0;  // signals stay the host's
  g_interpreter = std::make_unique<py::scoped_interpreter>(&config, 0, nullptr, false);
}

Interpreter::~Interpreter() { g_interpreter.reset(); }

GilRelease::GilRelease() : state_(PyEval_SaveThread()) {}

GilRelease::~GilRelease() { PyEval_RestoreThread(static_cast<PyThreadState*>(state_)); }

}  // namespace cpp_host

package kvxfertest

import (
	"os/exec"
	"syscall"
)

// dieWithParent has the kernel kill an agent process when the test's
// process ends, however it ends. (The signal follows the thread that
// started the process; Go ends a thread only when a goroutine locked to
// it exits, and the harness locks none.)
func dieWithParent(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}

// CPU model of the Ascend C API subset: implementations (included by kernel_operator.h).
#pragma once

#include <algorithm>
#include <sstream>

#include "topth_model/api_core.h"
#include "topth_model/api_sync.h"
#include "topth_model/api_copy.h"
#include "topth_model/api_vec.h"
#include "topth_model/api_reduce.h"
